"""What an implementation declares about its own conventions.

The suite checks an implementation against its declaration, never against
the embedded port's habits: a real port may need top-k widths in whole
kernel tiles, compute in bf16, write its own empty-row sentinel, or need a
head count its kernels support. An implementation without ``conventions``
gets the defaults, which are the embedded port's (and DESIGN.md's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dcpcheck.oracle.attention import SINK_SCHEMES
from dcpcheck.oracle.kv_cache import KV_CACHE_FORMATS


@dataclass(frozen=True)
class Conventions:
    # filter_index takes K a multiple of this; the suite pads its top-k with -1
    # to the next multiple and keeps its own K everywhere else.
    topk_multiple: int = 1
    # The dtype the attention layer rounds q, the caches and its output to;
    # the oracle rounds its inputs the same way and the tolerance is that of
    # the dtype the test asked for or this one, whichever is coarser. None: as given.
    layer_dtype: torch.dtype | None = None
    # The packed record the layer's caches hold (one of KV_CACHE_FORMATS, e.g.
    # vLLM's fp8_ds_mla): the suite draws the latents and states as that record
    # gives them back, so the oracle reads what the layer reads. None: plain rows.
    kv_cache_format: str | None = None
    # The LSE the implementation writes for a row with no candidate (and no sink).
    empty_lse: float = -1e30
    # Heads per rank the attention layer needs (its kernels' h_q); None: any.
    local_heads: int | None = None
    # LSE bases the combine is called with by the implementation itself.
    lse_bases: tuple[float, ...] = (2.0, math.e)
    # Where partial_attention and dcp_attention fold the sink, one of
    # SINK_SCHEMES: "rank0" (rank 0's partial only), "after_merge" (once into
    # the merged result), "minus_log_w" (sink - ln W into every rank's partial).
    sink_scheme: str = "rank0"
    # filter_index is also told the compress ratio of the layer whose top-k it
    # filters (``rho=``): a port that holds the interleave in vLLM's unit, tokens
    # (``--cp-kv-cache-interleave-size``), as a layer attribute needs the ratio
    # to have that attribute set as the server sets it.
    filter_takes_ratio: bool = False
    # The attention layer's forward runs its own prefill gather, not the
    # prefill_* capabilities: the suite counts the KV rows it all-gathers
    # instead of spying on those calls.
    fused_prefill: bool = False

    def __post_init__(self):
        if self.kv_cache_format is not None and self.kv_cache_format not in KV_CACHE_FORMATS:
            raise ValueError(
                f"Conventions.kv_cache_format={self.kv_cache_format!r}; accepted: None or "
                + ", ".join(map(repr, KV_CACHE_FORMATS))
            )
        if self.sink_scheme not in SINK_SCHEMES:
            raise ValueError(
                f"Conventions.sink_scheme={self.sink_scheme!r}; accepted: {', '.join(map(repr, SINK_SCHEMES))}"
            )


def conventions_of(impl) -> Conventions:
    return getattr(impl, "conventions", None) or Conventions()


def prefill_is_fused(impl) -> bool:
    """The layer's prefill gather is checked by the KV rows it all-gathers:
    declared, or no ``prefill_geometry`` to spy on."""
    return conventions_of(impl).fused_prefill or not callable(getattr(impl, "prefill_geometry", None))


def pad_topk(topk: torch.Tensor, multiple: int) -> torch.Tensor:
    """``topk`` [T, K] widened with -1 to a multiple of ``multiple`` columns (at least one tile)."""
    width = max(multiple, -(-topk.shape[1] // multiple) * multiple)
    if width == topk.shape[1]:
        return topk
    padded = torch.full((topk.shape[0], width), -1, dtype=topk.dtype, device=topk.device)
    padded[:, : topk.shape[1]] = topk
    return padded
