"""The sliding window served as vLLM serves DSV4.1's: pages of DSV4.1's SWA
block size (:func:`.tree.sources.swa_block_size`), a block table per request with
its pages out of order, the SWA cache allocated as vLLM allocates it, and the
step's SWA metadata from the tree's own SWA metadata builder.

The window is the suite's: a row of request token ``p`` reads the request's last
``min(p + 1, window)`` tokens, kept in the suite's window buffer at
``base + p`` (:func:`dcpcheck.scenarios.window.window_rows`). The driver checks
that this is the window vLLM's builder computes, then places the buffer's rows
in pages; what the layer reads is the builder's and the port's page arithmetic
over that block table.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import torch

from dcpcheck.impls.dsv41.server.layer import NULL_PAGE
from dcpcheck.impls.dsv41.tree.loading import patched
from dcpcheck.impls.dsv41.tree.sources import swa_block_size
from dcpcheck.scenarios.window import window_rows

SWA_CACHE_DTYPE = "auto"  # plain bf16 rows (dsv41@bfloat16); fp8_ds_mla pages come from .kv_cache_format


@dataclass
class WindowPages:
    """Where the step's window lives in pages (requests in vLLM's order)."""

    block_table: torch.Tensor  # [R, vLLM's row width] int32, NULL_PAGE where no page
    num_pages: int  # pages the SWA cache needs, the null page included
    slot_mapping: torch.Tensor  # [T'] int64: each row's own token's slot, -1 on padding rows
    fill_slots: torch.Tensor  # [N] int64: the slots of every token the step's windows read
    fill_rows: torch.Tensor  # [N] int64: the suite buffer's row of each of them


def swa_cache_spec(*, head_size: int, window: int, dtype: torch.dtype):
    """The tree's ``DeepseekV4SWACache.get_kv_cache_spec`` for a layer of that head size and window,
    run on what that cache's ``__init__`` stores (the page size: :func:`.tree.sources.swa_block_size`)."""
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    holder = types.SimpleNamespace(
        bounded_replay=False,
        block_size=swa_block_size(),
        head_dim=head_size,
        dtype=dtype,
        window_size=window,
        cache_config=types.SimpleNamespace(cache_dtype=SWA_CACHE_DTYPE),
        packed_bytes_per_token=None,
        packed_page_alignment=None,
        packed_block_stride_alignment=None,
    )
    return DeepseekV4SWACache.get_kv_cache_spec(holder, None)  # reads no VllmConfig field


def allocate_swa_cache(spec, num_pages: int, device) -> torch.Tensor:
    """One layer's SWA cache as vLLM allocates it (``v1/worker/utils.py`` ``allocate_kv_cache``: a byte buffer
    viewed by ``create_kv_cache_views``), bound as ``DeepseekV4SWACache.bind_kv_cache`` binds it: [pages, page, D]."""
    from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    page_bytes = spec.page_size_bytes
    raw = torch.zeros(num_pages * page_bytes, dtype=torch.int8, device=device)
    placement = KVCacheTensor(size=raw.numel(), layers=["swa_cache"], layer_stride=raw.numel(), block_stride=page_bytes)
    (view,) = create_kv_cache_views(raw, spec, num_pages, KVCacheLayout.LBHNC, placement)
    return view.squeeze(1)


def swa_builder(
    layer_cls, spec, *, window: int, decode_query_len: int, max_model_len: int, max_num_batched_tokens: int, device
):
    """The tree's SWA metadata builder (the layer's ``swa_backend_cls.get_builder_cls()``), its own
    ``__init__`` run on the fields of a VllmConfig it reads; decodes of ``decode_query_len`` tokens are
    MTP verifications (``num_speculative_tokens = decode_query_len - 1``, its decode threshold)."""
    ns = types.SimpleNamespace
    speculative = (
        None
        if decode_query_len == 1
        else ns(num_speculative_tokens=decode_query_len - 1, parallel_drafting=False, use_dspark=lambda: False)
    )
    config = ns(
        model_config=ns(max_model_len=max_model_len, hf_config=ns(sliding_window=window)),
        scheduler_config=ns(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_batched_tokens),
        parallel_config=ns(prefill_context_parallel_size=1),
        speculative_config=speculative,
    )
    builder_cls = layer_cls.swa_backend_cls.get_builder_cls()
    return builder_cls(spec, ["swa_cache"], config, torch.device(device))


class _Sm120Platform:
    """vLLM's platform as the port's SM120 target answers: its builder skips FlashMLA's tile-scheduler
    plan there (``sparse_swa.py`` ``build_tile_scheduler``), a CUDA extension a CPU host lacks."""

    def __init__(self, platform):
        self._platform = platform

    def is_device_capability_family(self, family: int) -> bool:
        return family == 120

    def __getattr__(self, name):
        return getattr(self._platform, name)


def _suite_split(num_decodes: int):
    """``split_decodes_and_prefills`` answering the suite's split: its step names its decode requests, and a
    prefill request may be no longer than a decode (a one-token chunk, or no rows on this rank), which vLLM's
    runner would reorder and its split count as a decode. The padding rows of a decode-only step are decodes."""

    def split(common, decode_threshold=1, **_):
        starts = common.query_start_loc_cpu
        decode_tokens = common.num_actual_tokens if num_decodes == common.num_reqs else int(starts[num_decodes])
        return num_decodes, common.num_reqs - num_decodes, decode_tokens, common.num_actual_tokens - decode_tokens

    return split


def build_swa_metadata(builder, *, pages: WindowPages, query_start, seq_lens, num_rows: int, num_decodes: int):
    """The step's ``DeepseekSparseSWAMetadata`` from the tree builder's ``build``, given vLLM's
    ``CommonAttentionMetadata`` of the step (rows in vLLM's order, ``num_rows`` with padding; its first
    ``num_decodes`` requests the suite's decodes)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    query_lens = query_start[1:] - query_start[:-1]
    common = CommonAttentionMetadata(
        query_start_loc=query_start,
        query_start_loc_cpu=query_start.cpu(),
        seq_lens=seq_lens,
        seq_lens_cpu_upper_bound=seq_lens.cpu(),
        num_reqs=int(seq_lens.numel()),
        num_actual_tokens=num_rows,
        max_query_len=int(query_lens.max()) if query_lens.numel() else 0,
        max_seq_len=int(seq_lens.max()) if seq_lens.numel() else 0,
        block_table_tensor=pages.block_table,
        slot_mapping=pages.slot_mapping,
    )
    module = sys.modules[builder.build_tile_scheduler.__module__]
    with patched(
        module,
        current_platform=_Sm120Platform(module.current_platform),
        split_decodes_and_prefills=_suite_split(num_decodes),
    ):
        return builder.build(0, common)


def place_window(vllm, swa_slots, positions, valid, token_to_req, seq_lens, *, table_width) -> WindowPages:
    """Pages for the suite's window: rows in vLLM's order (``token_to_req`` its request indices, 0 on
    padding rows), block-table rows ``table_width`` pages wide (vLLM's: :func:`.serving.block_table_width`).
    Each request's pages cover what its rows' windows read; earlier columns of its table are the null page,
    as vLLM frees pages the window has left. Pages are handed out from the pool's top down, so a request's
    next page is never the pool's next one. Slots come from vLLM's slot mapping (``v1/worker/block_table.py``)
    over that table."""
    device = swa_slots.device
    window = swa_slots.shape[1]
    page = swa_block_size()
    num_reqs = seq_lens.numel()
    rows = valid.nonzero().flatten()
    requests, row_positions = token_to_req[rows].long(), positions[rows].long()
    row_bases = swa_slots[rows, -1].long() - row_positions
    bases = torch.zeros(num_reqs, dtype=torch.int64, device=device).scatter_(0, requests, row_bases)
    expected = torch.full(swa_slots.shape, -1, dtype=torch.int64, device=device)
    expected[rows] = window_rows(
        row_positions, torch.ones_like(row_positions, dtype=torch.bool), bases[requests], window
    )
    if not torch.equal(swa_slots.long(), expected):
        raise ValueError(
            "the suite's window is not vLLM's (a row's last min(p + 1, window) tokens of its request, held "
            "at one base per request): the driver cannot serve it through the SWA builder"
        )
    first_read = torch.full((num_reqs,), 1 << 62, dtype=torch.int64, device=device)
    first_read.scatter_reduce_(0, requests, (row_positions - window + 1).clamp(min=0), "amin")
    read = first_read < (1 << 62)
    first_page = torch.where(read, first_read // page, 0)
    last_page = torch.where(read, (seq_lens.long() - 1) // page, -1)
    live = (last_page - first_page + 1).clamp(min=0)
    num_live = int(live.sum())
    block_table = torch.full((num_reqs, table_width), NULL_PAGE, dtype=torch.int32, device=device)
    pool_top_down = torch.arange(num_live, 0, -1, dtype=torch.int32, device=device)
    handed = 0
    for request in range(num_reqs):
        count = int(live[request])
        start = int(first_page[request])
        block_table[request, start : start + count] = pool_top_down[handed : handed + count]
        handed += count
    fill_requests = torch.repeat_interleave(torch.arange(num_reqs, device=device), live * page)
    fill_positions = torch.cat(
        [
            torch.arange(int(first_page[r]) * page, int(first_page[r]) * page + int(live[r]) * page, device=device)
            for r in range(num_reqs)
        ]
    )
    held = (fill_positions >= first_read[fill_requests]) & (fill_positions < seq_lens.long()[fill_requests])
    fill_requests, fill_positions = fill_requests[held], fill_positions[held]

    def slots(asked_positions, asked_requests):
        return vllm.token_slots(
            asked_positions,
            asked_requests.to(torch.int32),
            block_table,
            tokens_per_page=page,
            world_size=1,
            rank=0,
            token_interleave=1,
        )

    return WindowPages(
        block_table=block_table,
        num_pages=num_live + 1,
        slot_mapping=slots(torch.where(valid, positions.long(), -1), token_to_req),
        fill_slots=slots(fill_positions, fill_requests),
        fill_rows=bases[fill_requests] + fill_positions,
    )
