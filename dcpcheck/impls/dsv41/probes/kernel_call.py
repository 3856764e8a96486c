"""Finding 6's probe: the port's SM120 wrapper called once, into FlashInfer's
SM120 entry as the release the tree's vLLM pins defines it, with no fix
supplied (:mod:`.flashinfer_stand_in`).

Everywhere else the wrapper's call gets finding 6's fix where it omits exactly
that argument, so the later checks still run; here it meets the entry as it
would on SM120, and whatever the call raises is the finding.
"""

from __future__ import annotations

import torch

from dcpcheck.impls.dsv41.kernels.flashinfer_stand_in import ENTRY
from dcpcheck.impls.dsv41.tree.loading import SM120_WRAPPER, PortTree

# One token, the kernel's smallest head count, a window and a compressed segment.
PROBE_HEADS = 8
PROBE_HEAD_DIM = 64
# The failure finding 6 explains, as Python words it at the entry.
LSE_SCALE_MISSING = f"{ENTRY}() missing 1 required positional argument: 'lse_scale'"


def _probe_inputs(device: torch.device) -> tuple:
    """The wrapper's arguments, in its order (query ... lse), for one decode token."""
    bf16 = {"dtype": torch.bfloat16, "device": device}
    int32 = {"dtype": torch.int32, "device": device}
    return (
        torch.ones((1, PROBE_HEADS, PROBE_HEAD_DIM), **bf16),  # query
        torch.ones((4, 1, PROBE_HEAD_DIM), **bf16),  # swa_kv_cache: 4 one-token slots
        torch.zeros(1024, dtype=torch.uint8, device=device),  # workspace
        torch.tensor([[[0, 1, -1, -1]]], **int32),  # swa_indices
        torch.tensor([2], **int32),  # swa_lens
        torch.ones((2, 4, PROBE_HEAD_DIM), **bf16),  # compressed_kv_cache: 2 pages of 4 states
        torch.tensor([[[0, 5, -1, -1]]], **int32),  # extra_indices
        torch.tensor([2], **int32),  # extra_lens
        torch.empty((1, PROBE_HEADS, PROBE_HEAD_DIM), **bf16),  # out
        0.125,  # sm_scale
        torch.zeros(PROBE_HEADS, dtype=torch.float32, device=device),  # sinks
        torch.empty((1, PROBE_HEADS), dtype=torch.float32, device=device),  # lse
    )


def kernel_call_finding(tree: PortTree, device: torch.device) -> str | None:
    """What the port's call of FlashInfer's SM120 entry raises there, or None if it runs."""
    module = tree.module({})
    wrapper = getattr(module, SM120_WRAPPER).__wrapped__  # the tree's own function
    sources = tree.flashinfer.sources
    try:
        with tree.flashinfer.installed(strict=True):
            wrapper(*_probe_inputs(device))
    except (TypeError, ValueError) as exc:
        return (
            f"the port's {SM120_WRAPPER} ({module.__file__}) calls FlashInfer {sources.version}'s {ENTRY} "
            f"({sources.core}), and the call raises {type(exc).__name__}: {exc}: on SM120, at the first DCP "
            "forward of a compressed layer"
        )
    return None
