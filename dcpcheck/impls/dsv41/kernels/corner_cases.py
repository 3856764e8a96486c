"""One sparse-MLA call at the production shapes holding the corners of the kernel
contract (docs/dsv41.md, the SM120 kernel call row; CONTRACT.md §8.1), for
checking a real kernel against the reference on CPU (a fake of its interface)
and on a GPU (``tests/gpu/test_real_sparse_mla_kernel.py``).

Rows, each over a window segment and a compressed one in vLLM's 584-byte
fp8_ds_mla record at head dim 512:

0. every slot read and valid; 1. ``-1`` slots inside the lengths;
2. lengths shorter than the index width, the entries past them pointing at a
   NaN slot and past the cache's end (never read); 3. empty: both lengths 0;
4. empty by ``-1``: every read slot ``-1``; 5. the window segment only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dcpcheck.impls.dsv41.server.kv_cache_format import Fp8DsMlaRecord

HEAD_DIM = 512
PAGE = 64
PAGES = 4
SWA_WIDTH = 64
EXTRA_WIDTH = 192  # not a multiple of 128: the adapter pads it
EMPTY_ROWS = (3, 4)
ROWS = 6
SINK_LEVEL = 5.0


@dataclass
class SparseMlaCall:
    """The reference kernel's arguments (:func:`.reference.sparse_attention_with_lse`)."""

    query: torch.Tensor
    swa_kv_cache: torch.Tensor
    swa_indices: torch.Tensor
    swa_lens: torch.Tensor
    compressed_kv_cache: torch.Tensor
    extra_indices: torch.Tensor
    extra_lens: torch.Tensor
    out: torch.Tensor
    sm_scale: float
    sinks: torch.Tensor | None
    lse: torch.Tensor

    def args(self) -> tuple:
        return (
            self.query,
            self.swa_kv_cache,
            self.swa_indices,
            self.swa_lens,
            self.compressed_kv_cache,
            self.extra_indices,
            self.extra_lens,
            self.out,
            self.sm_scale,
            self.sinks,
            self.lse,
        )


def _cache(gen, device, nan_slot: int) -> torch.Tensor:
    record = Fp8DsMlaRecord(HEAD_DIM)
    cache = record.allocate(PAGES, PAGE, device)
    rows = torch.randn(PAGES * PAGE, HEAD_DIM, generator=gen)
    rows[nan_slot] = math.nan
    record.write(cache, torch.arange(PAGES * PAGE, device=device), rows.to(device))
    return cache


def _indices(gen, width: int, lens: list[int], device) -> torch.Tensor:
    num_slots = PAGES * PAGE
    nan_slot = num_slots - 1
    indices = torch.stack([torch.randperm(num_slots - 1, generator=gen)[:width] for _ in range(ROWS)])
    indices[1, ::3] = -1
    indices[2, lens[2] :: 2] = nan_slot  # unread: a NaN in the cache
    indices[2, lens[2] + 1 :: 2] = num_slots + 5  # unread: past the cache's end
    indices[4] = -1
    return indices.to(torch.int32).to(device)


def corner_call(num_heads: int, *, sink: bool, device="cpu", seed: int = 0) -> SparseMlaCall:
    """The corner rows at ``num_heads`` (the port's 8 a rank, up to 128), with or without a sink."""
    gen = torch.Generator().manual_seed(seed)
    nan_slot = PAGES * PAGE - 1
    swa_lens = [SWA_WIDTH, SWA_WIDTH, 5, 0, SWA_WIDTH, SWA_WIDTH]
    extra_lens = [EXTRA_WIDTH, EXTRA_WIDTH, 17, 0, EXTRA_WIDTH, 0]
    query = torch.randn(ROWS, num_heads, HEAD_DIM, generator=gen).to(torch.bfloat16)
    return SparseMlaCall(
        query=query.to(device),
        swa_kv_cache=_cache(gen, device, nan_slot),
        swa_indices=_indices(gen, SWA_WIDTH, swa_lens, device),
        swa_lens=torch.tensor(swa_lens, dtype=torch.int32, device=device),
        compressed_kv_cache=_cache(gen, device, nan_slot),
        extra_indices=_indices(gen, EXTRA_WIDTH, extra_lens, device),
        extra_lens=torch.tensor(extra_lens, dtype=torch.int32, device=device),
        out=torch.empty(ROWS, num_heads, HEAD_DIM, dtype=torch.bfloat16, device=device),
        sm_scale=HEAD_DIM**-0.5,
        # A sink near the rows' LSE (about ln of their candidates): it takes a share of every row.
        sinks=(torch.randn(num_heads, generator=gen) + SINK_LEVEL).to(device) if sink else None,
        lse=torch.empty(ROWS, num_heads, dtype=torch.float32, device=device),
    )


def through_port_wrapper(module, call: SparseMlaCall) -> None:
    """The call made by the port's own SM120 wrapper (``_sm120_sparse_attention_with_lse`` of its
    module as :class:`dcpcheck.impls.dsv41.tree.loading.PortTree` loads it)."""
    workspace = torch.empty(1, dtype=torch.uint8, device=call.query.device)
    module._sm120_sparse_attention_with_lse(
        call.query,
        call.swa_kv_cache,
        workspace,
        call.swa_indices,
        call.swa_lens,
        call.compressed_kv_cache,
        call.extra_indices,
        call.extra_lens,
        call.out,
        call.sm_scale,
        call.sinks,
        call.lse,
    )
