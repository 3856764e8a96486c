"""The combine launch context the port keeps across steps, and whether vLLM's combine kernel
launches a second time with it."""

from __future__ import annotations

import inspect
import sys

import torch

from dcpcheck.impls.dsv41.probes.common import PROBE_RATIO, PROBE_WORLD_SIZE, LocalAllGather, probe_device
from dcpcheck.impls.dsv41.stages.combine import run_step
from dcpcheck.impls.dsv41.tree.loading import patched


def kept_combine_context(build_layer):
    """The launch context two ``_run_sm120_dcp`` steps of one layer built for the ag_rs
    combine both hand ``cp_lse_ag_out_rs`` as ``ctx``; None where the steps hand no
    context or a new one each (vLLM's own callers). The steps are stage 3's
    (:func:`dcpcheck.impls.dsv41.stages.combine.run_step`, its kernel a stand-in), the combine a
    spy that records ``ctx``: this runs on any host."""
    layer = build_layer(0, PROBE_RATIO, backend="ag_rs")
    module = sys.modules[type(layer).__module__]
    signature = inspect.signature(module.cp_lse_ag_out_rs)
    handed = []

    def combine(*args, **kwargs):
        call = signature.bind(*args, **kwargs).arguments
        handed.append(call.get("ctx"))
        out = next(iter(call.values()))
        return out[:, : out.shape[1] // PROBE_WORLD_SIZE]

    device = probe_device()
    heads = layer.n_local_heads * PROBE_WORLD_SIZE
    out = torch.zeros((1, heads, layer.head_dim), dtype=torch.bfloat16, device=device)
    lse = torch.zeros((1, heads), dtype=torch.float32, device=device)
    swa_indices = torch.full((1, 1, 1), -1, dtype=torch.int32, device=device)
    swa_lens = torch.zeros(1, dtype=torch.int32, device=device)
    with patched(module, cp_lse_ag_out_rs=combine):
        run_step(
            layer, out, lse, torch.zeros(layer.n_local_heads), swa_indices, swa_lens, LocalAllGather(PROBE_WORLD_SIZE)
        )
    kept = len(handed) == 2 and handed[0] is not None and handed[0] is handed[1]
    return handed[0] if kept else None


def combine_context_finding(build_layer) -> str | None:
    """Can the combine launch context the port keeps across steps (:func:`kept_combine_context`)
    launch vLLM's combine kernel a second time on this host? Asked of compiled kernels
    only (a GPU); None where it can, or where no context is kept."""
    if not torch.cuda.is_available():
        return None
    import triton  # here, not at import: on CPU the adapter sets TRITON_INTERPRET before triton loads

    context = kept_combine_context(build_layer)
    if context is None:
        return None
    ops = sys.modules[type(context).__module__]
    fresh = type(context)()  # a context of the same class, never used by the layer
    out = torch.ones((4, 16, 64), dtype=torch.bfloat16, device="cuda")
    lses = torch.zeros((PROBE_WORLD_SIZE, 4, 16), dtype=torch.float32, device="cuda")
    try:
        for _ in range(2):
            ops.correct_attn_out(out.clone(), lses, 0, fresh, is_lse_base_on_e=False)
    except TypeError as exc:
        return (
            "the port keeps one CPTritonContext per layer and hands it to cp_lse_ag_out_rs as ctx= at every "
            "step (_run_sm120_dcp), and vLLM's CPTritonContext.call_kernel relaunches the combine "
            f"kernel it compiled with the non-constexpr arguments only, which Triton {triton.__version__}'s "
            f"launcher refuses: a context's second launch raises TypeError: {exc}. vLLM's own callers pass no "
            "context (a fresh one per call), so only the port meets it: every DCP layer's second ag_rs combine"
        )
    return None
