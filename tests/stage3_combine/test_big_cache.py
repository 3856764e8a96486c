"""Stage 3 past 2^31: attention reads cache rows whose element offset
(slot x D) does not fit in int32, as a realistic cache's do (DSV4's 512-wide
rows pass 2^31 elements at 4.2M slots, a 4 GiB bf16 cache). A kernel that
computes the offset in int32 reads some other row, or memory before the
cache, without any error.

The cache is allocated, not filled: only the rows a case writes are ever
touched, so the 4 GiB cache costs a few MB on CPU (the allocator maps such a
block lazily). The float64 oracle sees only the rows the slots read. On
CUDA a second case reads such a cache at the realistic profile (D = 512, 64
heads, a 256-row decode step, top-k 512).
"""

from __future__ import annotations

import pytest
import torch

from dcpcheck.compare import Expected, assert_close, assert_lse_close, assert_outputs
from dcpcheck.oracle import attention as oracle
from dcpcheck.scenarios.profiles import DSV4_FLASH
from dcpcheck.stages import STAGE_COMBINE

pytestmark = [pytest.mark.stage(STAGE_COMBINE), pytest.mark.needs("sparse_attention")]

HEAD_DIM = 64
NUM_HEADS = 8
NUM_TOKENS = 6
TOP_K = 12
# Slots on each side of element 2^31, around the first slot past it.
SLOTS_EACH_SIDE = 4096


def first_slot_past_2_31(head_dim: int) -> int:
    """The first slot whose first element is element 2^31 or later."""
    return -(-(2**31) // head_dim)


def big_cache_slots(gen: torch.Generator, *, head_dim: int, num_tokens: int, top_k: int) -> torch.Tensor:
    """[T, K]: half the slots below 2^31 elements, half past it (the cache's
    last slot included), a -1 among them."""
    first_past = first_slot_past_2_31(head_dim)
    low = torch.randint(first_past - SLOTS_EACH_SIDE, first_past, (num_tokens, top_k // 2), generator=gen)
    high = first_past + torch.randint(0, SLOTS_EACH_SIDE, (num_tokens, top_k - top_k // 2), generator=gen)
    slots = torch.cat([low, high], dim=1)
    slots[0, -1] = first_past + SLOTS_EACH_SIDE - 1
    slots[1, 0] = -1
    return slots


def check_sparse_attention_past_2_31(
    ctx, *, head_dim=HEAD_DIM, num_heads=NUM_HEADS, num_tokens=NUM_TOKENS, top_k=TOP_K
):
    gen, device = ctx.generator(), ctx.device
    slots = big_cache_slots(gen, head_dim=head_dim, num_tokens=num_tokens, top_k=top_k)
    num_slots = first_slot_past_2_31(head_dim) + SLOTS_EACH_SIDE
    cache = torch.empty((num_slots, head_dim), dtype=torch.bfloat16, device=device)
    used = torch.unique(slots[slots >= 0])
    cache[used.to(device)] = torch.randn(used.numel(), head_dim, generator=gen).to(device, torch.bfloat16)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(device, torch.bfloat16)
    scale = head_dim**-0.5

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
    context = {"stage": 3, "case": f"{num_slots} x {head_dim} bf16 cache, slots up to {num_slots - 1}, H={num_heads}"}
    assert_close(out, want_out, what="sparse_attention vs float64 oracle", context=context, dtype=torch.bfloat16)
    assert_lse_close(lse, want_lse, what="sparse_attention LSE vs float64 oracle", context=context)


@pytest.mark.world_sizes(1)  # rank-local: one rank holds the whole point
def test_sparse_attention_reads_rows_past_2_31_elements(dcp):
    dcp.run(check_sparse_attention_past_2_31)


@pytest.mark.gpu
@pytest.mark.gpu_memory(8)  # the 4 GiB cache, the gathered candidates and the float64 reference
@pytest.mark.world_sizes(1)
def test_sparse_attention_reads_rows_past_2_31_elements_at_the_realistic_profile(dcp):
    """DSV4's 512-wide rows cross element 2^31 at slot 4,194,304 (a 4 GiB bf16
    cache): a decode step of the realistic profile reads slots on both sides."""
    profile = DSV4_FLASH
    dcp.run(
        check_sparse_attention_past_2_31,
        head_dim=profile.head_dim,
        num_heads=profile.num_heads,
        num_tokens=profile.decode_rows[4],
        top_k=profile.top_k,
    )
