"""Stage 3 of the port, attention side: head gather, partial attention, and
the whole per-rank path (gather, partial, combine).

Torch, fp32 math. LSEs are base 2 of the scale-scaled logits, with the sink
folded into the denominator (DESIGN.md section 1).
"""

from __future__ import annotations

import math

import torch

from .combine import combine
from .conventions import EMPTY_LSE
from .triton_env import ATTENTION_TOKENS_PER_BLOCK

LOG2_E = 1.0 / math.log(2.0)


def gather_heads(x: torch.Tensor, group, *, dim: int = 1) -> torch.Tensor:
    """All-gather a head-sharded tensor in TP order (rank r's heads r-th):
    q [T, H_loc, D] -> [T, H, D] with dim=1, sinks [H_loc] -> [H] with dim=0."""
    return group.all_gather(x, dim=dim)


def _candidate_logits(
    q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (base-2 logits [T, H, K] fp32, -inf where slot = -1; rows [T, K, D] fp32)."""
    slots = slots.long()
    missing = slots < 0
    # Zero the rows behind -1 so stale cache contents (even NaN) never reach out.
    if cache.shape[0] == 0:  # an empty cache: every slot is -1
        rows = cache.new_zeros(slots.shape + cache.shape[1:], dtype=torch.float32)
    else:
        rows = cache[slots.clamp(min=0)].float().masked_fill(missing[:, :, None], 0.0)
    logits = torch.einsum("thd,tkd->thk", q, rows) * (scale * LOG2_E)
    return logits.masked_fill(missing[:, None, :], -math.inf), rows


def sparse_attention(
    q: torch.Tensor,
    comp_cache: torch.Tensor,
    comp_slots: torch.Tensor,
    swa_cache: torch.Tensor | None,
    swa_slots: torch.Tensor | None,
    sink: torch.Tensor | None,
    *,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every row over exactly its candidates (+ sink).
    -> (out [T, H, D] in q.dtype, lse [T, H] fp32 base 2; empty rows 0, EMPTY_LSE).

    Rows go ATTENTION_TOKENS_PER_BLOCK at a time: each block holds its
    candidates' rows in fp32, [T, K, D] (5.4 GiB for a 4096-row prefill at
    K = 640, D = 512)."""
    blocks = [
        _sparse_attention_block(
            q[start : start + ATTENTION_TOKENS_PER_BLOCK],
            comp_cache,
            None if comp_slots is None else comp_slots[start : start + ATTENTION_TOKENS_PER_BLOCK],
            swa_cache,
            None if swa_slots is None else swa_slots[start : start + ATTENTION_TOKENS_PER_BLOCK],
            sink,
            scale=scale,
        )
        for start in range(0, max(q.shape[0], 1), ATTENTION_TOKENS_PER_BLOCK)
    ]
    if len(blocks) == 1:
        return blocks[0]
    return torch.cat([out for out, _ in blocks]), torch.cat([lse for _, lse in blocks])


def _sparse_attention_block(q, comp_cache, comp_slots, swa_cache, swa_slots, sink, *, scale):
    num_tokens, num_heads, head_dim = q.shape
    q32 = q.float()
    candidates = [
        _candidate_logits(q32, cache, slots, scale)
        for cache, slots in ((comp_cache, comp_slots), (swa_cache, swa_slots))
        if cache is not None and slots is not None
    ]
    # The sink is one more candidate whose value row is zero (-inf without a sink).
    if sink is None:
        sink_logits = q32.new_full((num_tokens, num_heads), -math.inf)
    else:
        sink_logits = (sink.float() * LOG2_E).expand(num_tokens, num_heads)
    logits = torch.cat([*(logits for logits, _ in candidates), sink_logits[:, :, None]], dim=2)
    rows = torch.cat([*(rows for _, rows in candidates), q32.new_zeros(num_tokens, 1, head_dim)], dim=1)

    row_max = logits.amax(dim=2)
    empty = torch.isneginf(row_max)
    # Max-subtraction keeps exp2 in range; empty rows subtract 0 to avoid -inf - -inf.
    shift = row_max.masked_fill(empty, 0.0)
    probs = torch.exp2(logits - shift[:, :, None])
    denominator = probs.sum(dim=2)
    out = torch.einsum("thk,tkd->thd", probs, rows) / denominator.masked_fill(empty, 1.0)[:, :, None]
    lse = torch.where(empty, EMPTY_LSE, shift + torch.log2(denominator))
    return out.to(q.dtype), lse.float()


def partial_attention(
    q: torch.Tensor,
    comp_cache: torch.Tensor,
    comp_slots: torch.Tensor,
    swa_cache: torch.Tensor | None,
    swa_slots: torch.Tensor | None,
    sink: torch.Tensor | None,
    *,
    scale: float,
    rank: int,
    world_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One DCP rank's partial: its owned compressed slots, plus the window and
    the sink on rank 0 only (both are replicated; counting them on every rank
    would count them W times). ``world_size`` is part of the protocol (a
    port that folds ``sink - ln W`` on every rank needs it); this one does not."""
    if rank != 0:
        swa_cache, swa_slots, sink = None, None, None
    return sparse_attention(q, comp_cache, comp_slots, swa_cache, swa_slots, sink, scale=scale)


def dcp_attention(
    q_local: torch.Tensor,
    sink_local: torch.Tensor | None,
    comp_cache: torch.Tensor,
    comp_slots: torch.Tensor,
    swa_cache: torch.Tensor | None,
    swa_slots: torch.Tensor | None,
    group,
    *,
    scale: float,
    backend: str = "ag_rs",
    token_chunk: int | None = None,
) -> torch.Tensor:
    """The whole stage-3 path on one rank: gather q and sinks over heads,
    partial attention, combine. Rows go in sub-chunks of at most
    ``token_chunk`` tokens (bounds the gathered q and the partials).
    -> [T, H_loc, D] in q_local.dtype."""
    if token_chunk is not None and token_chunk < 1:
        raise ValueError(f"dcp_attention: token_chunk={token_chunk}; accepted: None or >= 1")
    sink = None if sink_local is None else gather_heads(sink_local, group, dim=0)
    num_tokens = q_local.shape[0]
    if num_tokens == 0:
        return q_local.new_empty(q_local.shape)
    step = token_chunk or num_tokens
    outputs = []
    for start in range(0, num_tokens, step):
        rows = slice(start, start + step)
        q = gather_heads(q_local[rows], group, dim=1)
        out, lse = partial_attention(
            q,
            comp_cache,
            comp_slots[rows],
            swa_cache,
            None if swa_slots is None else swa_slots[rows],
            sink,
            scale=scale,
            rank=group.rank_in_group,
            world_size=group.world_size,
        )
        outputs.append(combine(out, lse, group, backend=backend))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
