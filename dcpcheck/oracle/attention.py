"""Float64 DCP1 attention and the exact LSE merge: the reference of stage 3.

Plain torch, unsharded, no kernels. This module is the one home of the merge
math for the whole suite (tests import it; the port has its own copy because
the port is the code under test).

LSE convention (DESIGN.md section 1): ``lse = log_b(sum_j exp(z_j))`` with
natural logits ``z_j = scale * q.k_j``, i.e. the base-b logarithm of the
softmax denominator; a sink adds ``exp(sink)`` to that denominator. An empty
row has ``out = 0`` and ``lse = EMPTY_LSE``.

Sink schemes (docs/CONTRACT.md section 3): where a DCP port folds the sink
so that the merge of the W partials carries it exactly once.
"""

from __future__ import annotations

import math

import torch

# The LSE an empty row carries (what the port's kernels write).
EMPTY_LSE = -1e30
# Any LSE at or below this is an empty row (the empty band): -inf, -FLT_MAX,
# the sentinel -1e30, FlashInfer SM120's -1e29, and both after a base change
# (x ln 2 or / ln 2, at least -6.9e28). Above it an LSE is real mass, however
# negative (a finite mask of -5e4 gives about that).
EMPTY_LSE_BOUND = -1e28

# rank0: into rank 0's partial only (the embedded port, the seed DCP2 port);
# after_merge: once into the merged result, the partials carry none (vLLM's
# DSV4 DCP); minus_log_w: ``sink - ln W`` into every rank's partial, whose W
# terms exp(sink - ln W) sum to one exp(sink) (SGLang).
SINK_SCHEMES = ("rank0", "after_merge", "minus_log_w")


def is_empty_lse(lse: torch.Tensor) -> torch.Tensor:
    """Bool mask of rows that carry no attention mass (an LSE in the empty band)."""
    return lse <= EMPTY_LSE_BOUND


def _gather_candidates(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rows [T, K, D] float64, zero behind -1; valid [T, K] bool)."""
    slots = slots.long().cpu()
    valid = slots >= 0
    cache = cache.detach().cpu().to(torch.float64)
    if cache.shape[0] == 0:  # nothing to index: every slot must be -1
        return cache.new_zeros(slots.shape + cache.shape[1:]), valid
    rows = cache[slots.clamp(min=0)]
    return rows.masked_fill(~valid[:, :, None], 0.0), valid


def compact_candidates(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (only the rows of ``cache`` that ``slots`` reads, on CPU; ``slots``
    renumbered into them, -1 kept). :func:`sparse_attention` upcasts its whole
    cache to float64: hand it these when the cache is large."""
    slots = slots.long()
    used, renumbered = torch.unique(slots.clamp(min=0).cpu(), return_inverse=True)
    rows = cache[used.to(cache.device)].cpu()
    return rows, torch.where(slots.cpu() >= 0, renumbered, -1)


def sparse_attention(
    q: torch.Tensor,
    comp_cache: torch.Tensor,
    comp_slots: torch.Tensor,
    swa_cache: torch.Tensor | None,
    swa_slots: torch.Tensor | None,
    sink: torch.Tensor | None,
    *,
    scale: float,
    lse_base: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each row over exactly its candidates, in float64, on CPU.

    q [T, H, D]; comp_slots [T, K] and swa_slots [T, Wn] index rows of their
    caches (-1 = none; a repeated slot counts twice, as in any kernel);
    sink [H] natural-log logits or None.
    -> (out [T, H, D] float64, lse [T, H] float64 in ``lse_base``).
    """
    num_tokens, _, head_dim = q.shape
    sources = [(comp_cache, comp_slots), (swa_cache, swa_slots)]
    candidates = [
        _gather_candidates(cache, slots) for cache, slots in sources if cache is not None and slots is not None
    ]
    no_rows = torch.zeros(num_tokens, 0, head_dim, dtype=torch.float64)  # keeps cat valid with no source
    kv = torch.cat([rows for rows, _ in candidates] + [no_rows], dim=1)
    valid = torch.cat([ok for _, ok in candidates] + [no_rows[..., 0].bool()], dim=1)

    logits = torch.einsum("thd,tkd->thk", q.detach().cpu().to(torch.float64), kv) * scale
    logits = logits.masked_fill(~valid[:, None, :], -math.inf)
    if sink is not None:
        sink_logits = sink.detach().cpu().to(torch.float64).expand(num_tokens, -1)
        logits = torch.cat([logits, sink_logits[:, :, None]], dim=2)

    lse_natural = torch.logsumexp(logits, dim=2)
    empty = torch.isneginf(lse_natural)
    probs = torch.exp(logits - lse_natural.masked_fill(empty, 0.0)[:, :, None])
    out = torch.einsum("thk,tkd->thd", probs[:, :, : kv.shape[1]], kv)
    lse = (lse_natural / math.log(lse_base)).masked_fill(empty, EMPTY_LSE)
    return out, lse


def check_sink_scheme(scheme: str) -> None:
    if scheme not in SINK_SCHEMES:
        raise ValueError(f"sink scheme {scheme!r}; accepted: {', '.join(map(repr, SINK_SCHEMES))}")


def partial_sink(sink: torch.Tensor | None, *, scheme: str, rank: int, world_size: int) -> torch.Tensor | None:
    """The sink ``rank`` of ``world_size`` folds into its partial under
    ``scheme`` (None: it folds none). With it, the merge of the W partials
    carries the sink once, except under ``after_merge`` (:func:`finish_merge`)."""
    check_sink_scheme(scheme)
    if sink is None or scheme == "after_merge" or (scheme == "rank0" and rank != 0):
        return None
    if scheme == "minus_log_w":
        return sink.detach().cpu().to(torch.float64) - math.log(world_size)
    return sink


def fold_sink(
    out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor, *, lse_base: float = 2.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A result ``(out [T, H, D], lse [T, H] in lse_base)`` with the sink
    [H] folded in once, in float64: ``exp(sink)`` joins its denominator, so
    ``lse' = log_b(b^lse + exp(sink))`` and ``out' = out * b^(lse - lse')``.
    An empty row becomes the sink's: ``lse' = sink / ln b``, ``out' = 0``."""
    out = out.detach().cpu().to(torch.float64)
    lse = lse.detach().cpu().to(torch.float64)
    natural = (lse * math.log(lse_base)).masked_fill(is_empty_lse(lse), -math.inf)
    sink_natural = sink.detach().cpu().to(torch.float64).expand_as(natural)
    folded = torch.logaddexp(natural, sink_natural)
    weight = torch.exp(natural - folded)  # 0 for an empty row
    return torch.where(weight[..., None] > 0, out * weight[..., None], 0.0), folded / math.log(lse_base)


def finish_merge(
    out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor | None, *, scheme: str, lse_base: float = 2.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The end result of a merge of partials made under ``scheme``: under
    ``after_merge`` the sink is folded into it now (float64), under the
    other schemes the partials carried it and the merge is returned as given."""
    check_sink_scheme(scheme)
    if scheme != "after_merge" or sink is None:
        return out, lse
    return fold_sink(out, lse, sink, lse_base=lse_base)


def merge_partials(
    outs: torch.Tensor, lses: torch.Tensor, *, lse_base: float = 2.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of W partials, in float64, on CPU.

    outs [W, ..., D], lses [W, ...] in ``lse_base``:
    ``L = log_b(sum_r b^lse_r)``, ``o = sum_r b^(lse_r - L) out_r``.
    Empty partials (-inf or the sentinel) are the identity: no weight, and a
    NaN output under them is ignored. All-empty rows give out 0, EMPTY_LSE.
    -> (out [..., D] float64, lse [...] float64 in ``lse_base``).
    """
    outs = outs.detach().cpu().to(torch.float64)
    lses = lses.detach().cpu().to(torch.float64)
    empty = is_empty_lse(lses)
    natural = (lses * math.log(lse_base)).masked_fill(empty, -math.inf)
    merged_natural = torch.logsumexp(natural, dim=0)
    all_empty = torch.isneginf(merged_natural)
    weights = torch.exp(natural - merged_natural.masked_fill(all_empty, 0.0))
    contributions = torch.where(weights[..., None] > 0, weights[..., None] * outs, 0.0)
    out = contributions.sum(dim=0)
    lse = (merged_natural / math.log(lse_base)).masked_fill(all_empty, EMPTY_LSE)
    return out, lse


def convert_lse_base(lse: torch.Tensor, *, from_base: float, to_base: float) -> torch.Tensor:
    """The same LSE in another base; empty rows keep EMPTY_LSE."""
    converted = lse * (math.log(from_base) / math.log(to_base))
    return torch.where(is_empty_lse(lse), torch.full_like(lse, EMPTY_LSE), converted)
