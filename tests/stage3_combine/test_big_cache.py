"""Stage 3 past 2^31: attention reads cache rows whose element offset
(slot x D) does not fit in int32, as a realistic cache's do (DSV4's 512-wide
rows pass 2^31 elements at 4.2M slots, a 4 GiB bf16 cache). A kernel that
computes the offset in int32 reads some other row, or memory before the
cache, without any error.

The cache is allocated, not filled: only the rows a case writes are ever
touched, so the 4 GiB cache costs a few MB on CPU (the allocator maps such a
block lazily). The float64 oracle sees only the rows the slots read.
"""

from __future__ import annotations

import pytest
import torch

from dcpcheck.compare import Expected, assert_close, assert_lse_close, assert_outputs
from dcpcheck.oracle import attention as oracle
from dcpcheck.stages import STAGE_COMBINE

pytestmark = [pytest.mark.stage(STAGE_COMBINE), pytest.mark.needs("sparse_attention")]

HEAD_DIM = 64
NUM_HEADS = 8
NUM_TOKENS = 6
TOP_K = 12
FIRST_SLOT_PAST_2_31 = 2**31 // HEAD_DIM  # its first element is element 2^31
NUM_SLOTS = FIRST_SLOT_PAST_2_31 + 4096


def big_cache_slots(gen: torch.Generator) -> torch.Tensor:
    """[T, K]: half the slots below 2^31 elements, half past it (the cache's
    last slot included), a -1 among them."""
    low = torch.randint(0, 4096, (NUM_TOKENS, TOP_K // 2), generator=gen)
    high = FIRST_SLOT_PAST_2_31 + torch.randint(0, 4096, (NUM_TOKENS, TOP_K // 2), generator=gen)
    slots = torch.cat([low, high], dim=1)
    slots[0, -1] = NUM_SLOTS - 1
    slots[1, 0] = -1
    return slots


def check_sparse_attention_past_2_31(ctx):
    gen, device = ctx.generator(), ctx.device
    slots = big_cache_slots(gen)
    cache = torch.empty((NUM_SLOTS, HEAD_DIM), dtype=torch.bfloat16, device=device)
    used = torch.unique(slots[slots >= 0])
    cache[used.to(device)] = torch.randn(used.numel(), HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    q = torch.randn(NUM_TOKENS, NUM_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    scale = HEAD_DIM**-0.5

    result = ctx.impl.sparse_attention(q, cache, slots.to(device, torch.int32), None, None, None, scale=scale)
    out, lse = assert_outputs(
        "sparse_attention",
        result,
        (Expected("out", tuple(q.shape), torch.bfloat16), Expected("lse", tuple(q.shape[:2]), torch.float32)),
        device=device,
        context="cache rows past 2^31 elements",
    )
    rows, renumbered = oracle.compact_candidates(cache, slots)
    want_out, want_lse = oracle.sparse_attention(q, rows, renumbered, None, None, None, scale=scale)
    context = {"stage": 3, "case": f"{NUM_SLOTS} x {HEAD_DIM} bf16 cache, slots up to {NUM_SLOTS - 1}"}
    assert_close(out, want_out, what="sparse_attention vs float64 oracle", context=context, dtype=torch.bfloat16)
    assert_lse_close(lse, want_lse, what="sparse_attention LSE vs float64 oracle", context=context)


@pytest.mark.world_sizes(1)  # rank-local: one rank holds the whole point
def test_sparse_attention_reads_rows_past_2_31_elements(dcp):
    dcp.run(check_sparse_attention_past_2_31)
