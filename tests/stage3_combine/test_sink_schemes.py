"""Stage 3: the sharded-attention checks follow the declared sink scheme.

The implementation under test, re-arranged into a port of another scheme
(:class:`DeclaredScheme`: its own ``gather_heads``, ``sparse_attention`` and
``combine``, composed the way an ``after_merge`` or ``minus_log_w`` port
composes them, and declaring that scheme), passes every check of
:func:`tests.stage3_combine.sharded_attention.check_sharded_attention`:
the per-rank partial is checked against the declared scheme's, the end result
against DCP1 as for ``rank0``. A port that mixes schemes fails those checks
(the mutants ``SinkFoldedAgainAfterMerge``, ``SinkMinusLogWOnEveryRank`` and
``SinkLeftOutOfLse`` of ``dcpcheck/mutants/stage3.py``).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dcpcheck.impls.conventions import Conventions, conventions_of
from dcpcheck.oracle import attention as oracle
from dcpcheck.stages import STAGE_COMBINE
from tests.stage3_combine.sharded_attention import check_sharded_attention

pytestmark = [
    pytest.mark.stage(STAGE_COMBINE),
    pytest.mark.needs("gather_heads", "sparse_attention", "combine"),
]

LOG2_E = 1.0 / math.log(2.0)


class DeclaredScheme:
    """``impl``'s attention and combine, folding the sink by ``scheme``
    (``after_merge`` or ``minus_log_w``) and declaring it. The fold after the
    merge is this port's own fp32 code, not the oracle's: the check must not
    share the formula it checks."""

    def __init__(self, impl, scheme: str):
        self.name = f"{impl.name}+{scheme}"
        self.conventions = dataclasses.replace(conventions_of(impl), sink_scheme=scheme)
        self.scheme = scheme
        self.gather_heads = impl.gather_heads
        self.sparse_attention = impl.sparse_attention
        self.combine = impl.combine

    def partial_attention(self, q, comp_cache, comp_slots, swa_cache, swa_slots, sink, *, scale, rank, world_size):
        if rank != 0:
            swa_cache, swa_slots = None, None  # the window stays on rank 0 in every scheme
        if sink is not None:
            sink = None if self.scheme == "after_merge" else sink - math.log(world_size)
        return self.sparse_attention(q, comp_cache, comp_slots, swa_cache, swa_slots, sink, scale=scale)

    def dcp_attention(
        self,
        q_local,
        sink_local,
        comp_cache,
        comp_slots,
        swa_cache,
        swa_slots,
        group,
        *,
        scale,
        backend="ag_rs",
        token_chunk=None,
    ):
        sink = None if sink_local is None else self.gather_heads(sink_local, group, dim=0)
        step = token_chunk or max(1, q_local.shape[0])
        outputs = []
        for start in range(0, q_local.shape[0], step):
            rows = slice(start, start + step)
            out, lse = self.partial_attention(
                self.gather_heads(q_local[rows], group, dim=1),
                comp_cache,
                comp_slots[rows],
                swa_cache,
                None if swa_slots is None else swa_slots[rows],
                sink,
                scale=scale,
                rank=group.rank_in_group,
                world_size=group.world_size,
            )
            merged, merged_lse = self.combine(out, lse, group, backend=backend, return_lse=True)
            if self.scheme == "after_merge" and sink_local is not None:
                merged = fold_sink_after_merge(merged, merged_lse, sink_local)
            outputs.append(merged)
        return torch.cat(outputs, dim=0) if outputs else q_local.new_empty(q_local.shape)


def fold_sink_after_merge(merged: torch.Tensor, merged_lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """``merged`` [T, H_loc, D] rescaled by its share of the denominator once
    ``exp(sink)`` joins it: ``2^lse / (2^lse + e^sink)``, in fp32 (0 for an empty row)."""
    sink2 = (sink.float() * LOG2_E).expand_as(merged_lse)
    share = torch.exp2(merged_lse - torch.logaddexp2(merged_lse, sink2))
    return (merged.float() * share[..., None]).to(merged.dtype)


def check_declared_scheme(ctx, *, scheme, **case):
    return check_sharded_attention(dataclasses.replace(ctx, impl=DeclaredScheme(ctx.impl, scheme)), **case)


@pytest.mark.parametrize(
    "scheme, backend, lse_base, dtype_name, interleave, bs",
    [
        ("after_merge", "a2a", "e", "bf16", 2, 8),
        ("minus_log_w", "ag_rs", "2", "fp32", 1, 4),
    ],
)
def test_declared_sink_scheme_passes(dcp, scheme, backend, lse_base, dtype_name, interleave, bs):
    dcp.run(
        check_declared_scheme,
        scheme=scheme,
        backend=backend,
        lse_base=lse_base,
        dtype_name=dtype_name,
        interleave=interleave,
        bs=bs,
    )


def test_unknown_sink_scheme_is_refused_naming_the_accepted_ones():
    with pytest.raises(ValueError, match="sink_scheme='every_rank'; accepted: 'rank0', 'after_merge', 'minus_log_w'"):
        Conventions(sink_scheme="every_rank")


def test_oracle_fold_after_the_merge_is_the_sink_folded_into_the_attention():
    """``fold_sink`` of attention without the sink == attention with it (rows
    with candidates, and one row with none: the sink's LSE, output 0)."""
    gen = torch.Generator().manual_seed(0)
    q, cache = torch.randn(3, 2, 8, generator=gen), torch.randn(5, 8, generator=gen)
    slots = torch.tensor([[0, 1, 2], [3, 4, -1], [-1, -1, -1]], dtype=torch.int32)
    sink = torch.tensor([1.5, -0.5])
    for base in (2.0, math.e):
        bare = oracle.sparse_attention(q, cache, slots, None, None, None, scale=0.3, lse_base=base)
        folded = oracle.fold_sink(*bare, sink, lse_base=base)
        want = oracle.sparse_attention(q, cache, slots, None, None, sink, scale=0.3, lse_base=base)
        for got, expected in zip(folded, want):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
