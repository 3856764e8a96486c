"""Stage 3's combine on the port's own ``_run_sm120_dcp``.

The port fuses the sink gather (``_dcp_attn_sink``), the neutral window of
ranks other than 0 (``_dcp_neutral_swa``), its kernel call and the combine
into one step. Each call here runs that step twice (a served layer runs many;
the second call meets what the first left on it) on a layer of this rank
(8 local heads, the given head dim, the combine backend read from
``DSV41_DCP_COMBINE`` at ``__init__`` as the port reads it), with the
module's ``_sm120_sparse_attention_with_lse`` replaced for the call by a
stand-in that writes the given per-rank partials into the port's
``out_gathered`` / ``lse`` buffers and records the sink and window rows the
port handed it. The result is the port's ``output`` after its own combine.

Its domain is the port's: bf16 partials, base-2 LSEs, no merged LSE out
(``_run_sm120_dcp`` keeps none), W > 1, ``H = local_heads * W``.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass

import torch

from dcpcheck.impls.dsv41.kernels import reference as reference_kernel
from dcpcheck.impls.dsv41.server.coordinator import layer_group
from dcpcheck.impls.dsv41.tree.loading import cuda_query_stand_ins, patched

KERNEL_SIGNATURE = inspect.signature(reference_kernel.sm120_sparse_attention_with_lse)


@dataclass(frozen=True)
class KernelInputs:
    """What ``_run_sm120_dcp`` handed its kernel on this rank."""

    sink: torch.Tensor | None  # [H] fp32, or None
    swa_indices: torch.Tensor  # [T, 1, N] int32
    swa_lens: torch.Tensor  # [T] int32


def in_port_domain(out, group, *, lse_base: float, return_lse: bool, local_heads: int) -> bool:
    return (
        group.world_size > 1
        and out.dtype == torch.bfloat16
        and lse_base == 2.0
        and not return_lse
        and out.shape[1] == local_heads * group.world_size
    )


def run_step(layer, out, lse, sink, swa_indices, swa_lens, group, *, calling=None) -> tuple[torch.Tensor, KernelInputs]:
    """One ``_run_sm120_dcp`` of ``layer`` whose kernel writes ``out`` / ``lse``
    (this rank's partials of every gathered head), the layer's sink ``sink``
    [H_loc] and window rows ``swa_indices`` / ``swa_lens`` handed to the step.
    ``calling(layer)``: a context manager around each call into the layer (the
    case's cures; none: as it is).
    -> (the step's output [T, H_loc, D], what its kernel was handed)."""
    num_tokens, num_heads, head_dim = out.shape
    seen = {}

    def kernel(*args, **kwargs):
        call = KERNEL_SIGNATURE.bind(*args, **kwargs).arguments
        call["out"].copy_(out)
        call["lse"].copy_(lse)
        sinks = call["sinks"]
        seen.update(
            sink=None if sinks is None else sinks.clone(),
            swa_indices=call["swa_indices"].clone(),
            swa_lens=call["swa_lens"].clone(),
        )

    q = torch.zeros((num_tokens, num_heads // group.world_size, head_dim), dtype=torch.bfloat16, device=out.device)
    output = torch.empty_like(q)
    attn_sink = torch.nn.Parameter(sink.float().to(out.device), requires_grad=False)
    module = sys.modules[type(layer).__module__]
    # The gathered sink is cached on the layer after its first gather: a fresh one per call.
    with (
        cuda_query_stand_ins(),
        patched(module, _sm120_sparse_attention_with_lse=kernel),
        patched(layer, dcp_group=layer_group(group), attn_sink=attn_sink, _dcp_sink=None),
    ):
        # Twice: a served layer runs every step, and what its first call leaves on
        # it (the gathered sink, the combine's launch context) serves the later ones.
        for _ in range(2):
            with calling(layer) if calling else contextlib.nullcontext():
                layer._run_sm120_dcp(
                    q, out.new_empty((1, 1, head_dim)), swa_indices, swa_lens, None, None, None, output
                )
    return output, KernelInputs(**seen)
