"""A layer's compressed cache placed in a KV pool as large as a served one: its pages past a byte offset.

vLLM allocates one backing buffer for the KV cache (``v1/worker/utils.py`` ``allocate_kv_cache``) and views it
per layer (``v1/kv_cache_interface.py`` ``create_kv_cache_views``): layer ``l``'s block ``b`` starts
``offset + l * layer_stride + b * block_stride`` bytes in (``KVCacheTensor``), so on a served GPU a block
id times the page's bytes passes 2^31 and an int32 byte offset wraps. Here the suite's cache (page ``p``,
``NULL_PAGE`` first) is mirrored into a pool whose page ``p >= 1`` is ``p + shift``, the first of them at
``offset_bytes`` or past it; page 0 stays the null page (vLLM's ``BlockPool`` keeps block 0 as its null
block). The pool is ``torch.empty``: only the pages the suite writes are touched, so a 2+ GiB pool costs
a few MB on a CPU host (the rest is never faulted in).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dcpcheck.impls.dsv41.server.kv_cache_format import FP8_DS_MLA, Fp8DsMlaRecord

NULL_PAGE = 0


@dataclass(frozen=True)
class PooledCache:
    cache: torch.Tensor  # [pool pages, page, C]: the layer's view of the pool
    shift: int  # suite page p >= 1 is pool page p + shift


def page_bytes(kv_cache_dtype: str, page: int, head_dim: int) -> int:
    """A page's stride in bytes: the fp8_ds_mla record's padded page, or bf16 rows."""
    if kv_cache_dtype == FP8_DS_MLA:
        return Fp8DsMlaRecord(head_dim).page_stride(page)
    return page * head_dim * 2


def allocate_pooled(
    kv_cache_dtype: str, num_pages: int, page: int, head_dim: int, device, *, offset_bytes: int
) -> PooledCache:
    """A pool holding ``num_pages`` suite pages, every one but the null page at ``offset_bytes`` or past it."""
    stride = page_bytes(kv_cache_dtype, page, head_dim)
    first = -(-offset_bytes // stride)
    pool_pages = first + num_pages - 1
    raw = torch.empty(pool_pages * stride, dtype=torch.uint8, device=device)
    if kv_cache_dtype == FP8_DS_MLA:
        width = Fp8DsMlaRecord(head_dim).bytes_per_token
        cache = raw.as_strided((pool_pages, page, width), (stride, width, 1))
    else:
        cache = raw.view(torch.bfloat16).view(pool_pages, page, head_dim)
    return PooledCache(cache, first - 1)


def pool_slots(slots: torch.Tensor, page: int, shift: int) -> torch.Tensor:
    """Suite slots (``page_index * page + offset``) as the pool's: every page but the null page moved on."""
    return torch.where(slots >= page, slots + shift * page, slots)


def shift_table(block_table: torch.Tensor, shift: int) -> None:
    """A block table's pages moved into the pool, in place (the null page stays)."""
    block_table.add_(torch.where(block_table != NULL_PAGE, shift, 0).to(block_table.dtype))
