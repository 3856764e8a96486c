"""One step of vLLM's model runner around the real layer: metadata, row order,
the shared top-k buffer, cache views; see :mod:`.layer` for what is modelled."""

from __future__ import annotations

import sys
import types
import weakref
from dataclasses import dataclass

import torch

from dcpcheck.impls.dsv41.server import kv_cache_format, kv_pool
from dcpcheck.impls.dsv41.server.layer import NULL_PAGE, LayerSpec, build_port_layer, index_topk, padded_topk_width
from dcpcheck.impls.dsv41.server.metadata import block_table_width, build_compressed_metadata, compressed_cache_spec
from dcpcheck.impls.dsv41.server.swa_pages import (
    WindowPages,
    allocate_swa_cache,
    build_swa_metadata,
    place_window,
    swa_builder,
    swa_cache_spec,
)
from dcpcheck.impls.dsv41.server.token_slots import tree_token_slots
from dcpcheck.impls.dsv41.tree.loading import cuda_query_stand_ins, patched
from dcpcheck.impls.dsv41.tree.sources import swa_block_size

MIRROR_ROWS = 1 << 16  # rows of a suite cache written into the layer's cache at once


@dataclass
class StepMetadata:
    """One step's metadata for the layers of one KV layout (vLLM's per-KV-group objects)."""

    swa: object  # DeepseekSparseSWAMetadata, from the tree's SWA builder
    swa_pages: WindowPages  # where the suite's window buffer sits in SWA pages
    window: int
    compressed: object | None  # DeepseekV4FlashMLAMetadata (rho >= 1)
    order: torch.Tensor  # [T'] rows of the suite's step, in vLLM's order
    num_rows: int  # T: rows of the suite's step
    comp_write_slots: torch.Tensor | None  # [T] int64, suite order
    swa_write_slots: torch.Tensor | None  # [T] int64, suite order
    layout: tuple
    pool_shift: int = 0  # the compressed block table's pages moved into a KV pool by this (kv_pool)


def check_sources_agree(layer, stack) -> None:
    """The tree's kv and index source of a layer are the suite's (dcpcheck.scenarios.topology)."""
    layer_id = stack.layer_id
    for what, tree_source, suite_source in (
        ("kv", layer.kv_source_layer_id, stack.topology.kv_source(layer_id)),
        ("index", layer.index_source_layer_id, stack.topology.index_source(layer_id)),
    ):
        if tree_source != suite_source:
            raise ValueError(
                f"layer {layer_id} of {stack.topology}: the tree's DeepseekV4Attention.__init__ gives it {what} "
                f"source {tree_source}, dcpcheck's model of DSV4.1 (dcpcheck/scenarios/topology.py) {suite_source}"
            )


class PortAttention:
    """What ``build_attention`` returns for the dsv41 implementation: one
    attention layer of the stack, backed by the tree's real layer."""

    def __init__(
        self,
        impl,
        layout,
        group,
        *,
        layer_id,
        backend,
        prefill_gather,
        prefill_token_chunk,
        max_model_len,
        stack=None,
        topk_width=None,
        kv_pool_offset=None,
    ):
        """``topk_width``: the checkpoint's ``index_topk`` (the model-wide top-k buffer's width and the
        metadata builder's ``topk_tokens``; None: :func:`index_topk`). ``kv_pool_offset``: bytes; the
        compressed cache's pages sit at or past it in a pool as vLLM allocates it (:mod:`.kv_pool`)."""
        self.impl = impl
        self.topk_width = index_topk() if topk_width is None else topk_width
        self.kv_pool_offset = kv_pool_offset
        self.stack = stack
        self.group = group
        self.rho, self.bs, self.interleave, self.world_size = (
            layout.rho,
            layout.bs,
            layout.interleave,
            layout.world_size,
        )
        self.layer_id = layer_id
        self.backend = backend
        self.prefill_gather = prefill_gather
        self.prefill_token_chunk = prefill_token_chunk
        self.max_model_len = max_model_len
        # vLLM's row, so a page past max_model_len / W (a porter's bound on the global page, say) is outside it.
        self.compressed_table_width = (
            block_table_width(
                compressed_cache_spec(impl.tree, rho=self.rho, tokens_per_page=self.bs * self.rho),
                max_model_len=max_model_len,
                dcp_world_size=self.world_size,
            )
            if self.rho >= 1
            else None
        )
        self._layer = None
        self._swa_builders: dict[tuple, object] = {}  # (window, widest decode, device) -> the tree's SWA builder
        self._swa_cache: torch.Tensor | None = None  # this layer's SWA pages, as vLLM allocates them

    @property
    def layout(self):
        return (self.rho, self.bs, self.interleave, self.world_size)

    # ---- per step and KV layout -----------------------------------------
    def plan_step(
        self,
        *,
        seq_lens,
        token_to_req,
        positions,
        is_valid_token,
        is_prefill_request,
        swa_slots,
        swa_write_slots=None,
        block_table=None,
    ):
        device = token_to_req.device
        num_rows = token_to_req.shape[0]
        requests = token_to_req.long()
        is_prefill = is_prefill_request.bool()
        request_order = torch.cat([(~is_prefill).nonzero().flatten(), is_prefill.nonzero().flatten()])
        new_index = torch.empty_like(request_order)
        new_index[request_order] = torch.arange(request_order.numel(), device=device)
        valid = is_valid_token.bool()
        real_rows = valid.nonzero().flatten()
        real_rows = real_rows[torch.argsort(new_index[requests[real_rows]], stable=True)]
        padding_rows = (~valid).nonzero().flatten()
        decode_only = not bool(is_prefill.any())
        order = torch.cat([real_rows, padding_rows]) if decode_only else real_rows
        query_lens = torch.bincount(new_index[requests[real_rows]], minlength=request_order.numel())
        num_decodes = int((~is_prefill).sum())

        token_to_req_new = torch.where(valid[order], new_index[requests[order]], 0).to(torch.int32)
        query_start = torch.zeros(request_order.numel() + 1, dtype=torch.int32, device=device)
        query_start[1:] = torch.cumsum(query_lens, 0)
        seq_lens_new = seq_lens[request_order].to(torch.int32)
        window = swa_slots.shape[1]
        # The builder's decode threshold, 1 + num_speculative_tokens: the widest decode (MTP verification).
        decode_query_len = int(query_lens[:num_decodes].max()) if num_decodes else 1
        swa_builder = self._swa_builder(window, decode_query_len, device)
        swa_pages = place_window(
            self.impl.vllm,
            swa_slots[order],
            positions[order],
            valid[order],
            token_to_req_new,
            seq_lens_new,
            # The window is replicated on every rank, as the port reads it (finding 5): its row is not DCP-sharded.
            table_width=block_table_width(
                swa_builder.kv_cache_spec, max_model_len=self.max_model_len, dcp_world_size=1
            ),
        )
        swa = build_swa_metadata(
            swa_builder,
            pages=swa_pages,
            query_start=query_start,
            seq_lens=seq_lens_new,
            num_rows=order.numel(),
            num_decodes=num_decodes,
        )
        compressed = comp_write_slots = None
        if self.rho >= 1:
            compressed, comp_write_slots = self._compressed_metadata(
                seq_lens,
                token_to_req,
                positions,
                valid,
                block_table,
                request_order,
                query_start,
                order,
                token_to_req_new,
                num_rows,
            )
        return StepMetadata(
            swa,
            swa_pages,
            window,
            compressed,
            order,
            num_rows,
            comp_write_slots,
            swa_write_slots,
            self.layout,
        )

    def _swa_builder(self, window: int, decode_query_len: int, device):
        """The tree's SWA metadata builder, one per window, widest decode and device, as vLLM keeps one per
        KV group. Its spec's head size is the one the SWA backend serves: ``build`` reads only the page size."""
        from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWABackend

        key = (window, decode_query_len, torch.device(device))
        if key not in self._swa_builders:
            layer_cls = getattr(self.impl.tree.module({}), self.impl.tree.spec.cls)
            spec = swa_cache_spec(
                head_size=DeepseekSparseSWABackend.get_supported_head_sizes()[0], window=window, dtype=torch.bfloat16
            )
            self._swa_builders[key] = swa_builder(
                layer_cls,
                spec,
                window=window,
                decode_query_len=decode_query_len,
                max_model_len=self.max_model_len,
                max_num_batched_tokens=self.impl.max_num_batched_tokens,
                device=device,
            )
        return self._swa_builders[key]

    def _compressed_metadata(
        self,
        seq_lens,
        token_to_req,
        positions,
        valid,
        block_table,
        request_order,
        query_start,
        order,
        token_to_req_new,
        num_rows,
    ):
        """The step's compressed metadata from the tree's builder, over block-table
        rows as wide as vLLM's (``compressed_table_width``); and the compressed write slots (suite
        order): the tree's, unless its writer places no state by DCP (then
        vLLM's own DCP writer stands in, so the read side is still checked)."""
        device = token_to_req.device
        width = self.compressed_table_width
        if bool((block_table[:, width:] != NULL_PAGE).any()):
            raise ValueError(
                f"a request of the step holds a page past column {width} of rank {self.group.rank_in_group}'s "
                f"block table, vLLM's row at max_model_len={self.max_model_len} and W={self.world_size}: it is "
                "longer than max_model_len, which vLLM refuses (v1/engine/input_processor.py _validate_prompt_len)"
            )
        kept = min(width, block_table.shape[1])
        wide = torch.full((request_order.numel(), width), NULL_PAGE, dtype=torch.int32, device=device)
        wide[:, :kept] = block_table[request_order, :kept]
        live_positions = torch.where(valid, positions, -1)
        token_slots = tree_token_slots(
            self.impl.vllm,
            live_positions,
            token_to_req,
            block_table,
            tokens_per_page=self.bs * self.rho,
            world_size=self.world_size,
            rank=self.group.rank_in_group,
            token_interleave=self.interleave * self.rho,
        )
        compressed = build_compressed_metadata(
            self.impl.tree,
            rho=self.rho,
            tokens_per_page=self.bs * self.rho,
            token_slots=token_slots[order],
            query_start_loc=query_start,
            seq_lens=seq_lens[request_order].to(torch.int32),
            block_table=wide,
            token_to_req=token_to_req_new,
            num_actual_tokens=int(valid.sum()),
            topk_tokens=self.topk_width,
        )
        if not hasattr(compressed, "seq_lens"):
            # The port's stage-9 gather reads attn_metadata.seq_lens, a field the
            # DCP2 stack's sparse_mla.py adds (vLLM 0.33.0's metadata lacks it):
            # global sequence lengths, as the gather's page count reads them.
            compressed.seq_lens = seq_lens[request_order].to(torch.int32)
        if self.world_size == 1 or self.impl.findings.compressed_writer is None:
            write_slots = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
            # The builder maps the step's real tokens (padding rows come after them).
            mapped = compressed.slot_mapping[: order.numel()]
            write_slots[order[: mapped.numel()]] = mapped.to(torch.int64)
        else:
            write_slots = self.impl.slot_mapping(
                live_positions,
                token_to_req,
                block_table,
                rho=self.rho,
                bs=self.bs,
                world_size=self.world_size,
                rank=self.group.rank_in_group,
                interleave=self.interleave,
            )
        return compressed, write_slots

    # ---- per layer -------------------------------------------------------
    def _port_layer(self, q_local: torch.Tensor, sink: torch.Tensor, window: int):
        if self._layer is None:
            spec = LayerSpec(
                layer_id=self.layer_id,
                rho=self.rho,
                bs=self.bs,
                interleave=self.interleave,
                world_size=self.world_size,
                rank=self.group.rank_in_group,
                local_heads=q_local.shape[1],
                head_dim=q_local.shape[2],
                window=window,
                sink=sink,
                topk_buffer=self.impl.topk_buffer(self.group.device, self.topk_width),
                max_num_batched_tokens=self.impl.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                topology=None if self.stack is None else self.stack.topology,
                kv_cache_dtype=self.impl.kv_cache_dtype,
            )
            self._layer, _ = build_port_layer(
                self.impl.tree,
                self.group,
                spec,
                backend=self.backend,
                prefill_token_chunk=self.prefill_token_chunk,
                prefill_gather=self.prefill_gather,
            )
            if self.stack is not None:
                check_sources_agree(self._layer, self.stack)
            self._sink = sink.clone()
        elif not torch.equal(sink, self._sink):
            raise ValueError("the dsv41 layer's sink is a weight: it cannot change between forwards")
        return self._layer

    def _mirror(self, cache: torch.Tensor, page: int) -> tuple[torch.Tensor, int]:
        """A suite cache ``[pages * page, D]`` as the layer reads it, in its ``kv_cache_dtype``
        (:mod:`.kv_cache_format`), refreshed; one per cache for the whole process, so layers
        sharing a kv source's cache see one address, as in vLLM. -> (the cache, the shift of its
        pages into a KV pool: 0 without ``kv_pool_offset``)."""
        known = self.impl.cache_mirrors.get(id(cache))
        if known is None or known[0]() is not cache:
            num_pages, head_dim = cache.shape[0] // page, cache.shape[1]
            if self.kv_pool_offset is None:
                mirror = kv_pool.PooledCache(
                    kv_cache_format.allocate(self.impl.kv_cache_dtype, num_pages, page, head_dim, cache.device), 0
                )
            else:
                mirror = kv_pool.allocate_pooled(
                    self.impl.kv_cache_dtype, num_pages, page, head_dim, cache.device, offset_bytes=self.kv_pool_offset
                )
            known = (weakref.ref(cache), mirror)
            self.impl.cache_mirrors[id(cache)] = known
            # Dropped with the suite's cache: a rank serves many cases, and each served case's pool is
            # gigabytes (on an H100 a pool kept per case grew a W = 2 rank by 2.7 GiB a case, to 27 GiB).
            weakref.finalize(cache, self.impl.cache_mirrors.pop, id(cache), None)
        mirror = known[1]
        # In pieces: the writer's fp32 temporaries of a served cache's every row would be gigabytes.
        for start in range(0, cache.shape[0], MIRROR_ROWS):
            rows = torch.arange(start, min(start + MIRROR_ROWS, cache.shape[0]), device=cache.device)
            kv_cache_format.write(mirror.cache, kv_pool.pool_slots(rows, page, mirror.shift), cache[rows])
        return mirror.cache, mirror.shift

    def _swa_pages(self, swa_cache: torch.Tensor, plan: StepMetadata, head_dim: int) -> torch.Tensor:
        """This layer's SWA cache as vLLM allocates it, holding at their slots the suite buffer's rows the
        step's windows read; every other slot NaN, so a read outside the window poisons the output."""
        pages = plan.swa_pages
        cache = self._swa_cache
        if cache is None or cache.shape[0] < pages.num_pages:
            if self.impl.kv_cache_dtype == kv_cache_format.FP8_DS_MLA:
                # vLLM's packed page (its padding as vLLM pads it), in the record scaled to head_dim.
                cache = kv_cache_format.allocate(
                    self.impl.kv_cache_dtype, pages.num_pages, swa_block_size(), head_dim, swa_cache.device
                )
            else:
                spec = swa_cache_spec(head_size=head_dim, window=plan.window, dtype=torch.bfloat16)
                cache = allocate_swa_cache(spec, pages.num_pages, swa_cache.device)
            self._swa_cache = cache
        every_slot = torch.arange(cache.shape[0] * cache.shape[1], device=cache.device)
        kv_cache_format.write(
            cache, every_slot, torch.full((every_slot.numel(), head_dim), float("nan"), device=cache.device)
        )
        kv_cache_format.write(cache, pages.fill_slots, swa_cache[pages.fill_rows])
        return cache

    @staticmethod
    def _forward_context(layer, plan: StepMetadata, comp):
        """What ``forward_mqa`` finds, as vLLM's runner leaves it: the step's metadata dict (each
        of the layer's cache prefixes to its group's one object, ``v1/worker/gpu_model_runner.py``)
        and the compressed cache bound on its kv source (``bind_kv_cache``), which a layer reading
        another source's cache looks up in the static forward context by that source's prefix."""
        attn_metadata = {layer.swa_cache_layer.prefix: plan.swa}
        if layer.compressed_cache_prefix is not None:
            attn_metadata[layer.compressed_cache_prefix] = plan.compressed
            if layer.is_kv_source:
                layer.kv_cache = comp
            else:
                layer._static_forward_context = {layer.compressed_cache_prefix: types.SimpleNamespace(kv_cache=comp)}
        module = sys.modules[type(layer).__module__]
        return patched(module, get_forward_context=lambda: types.SimpleNamespace(attn_metadata=attn_metadata))

    def forward(
        self,
        plan: StepMetadata,
        *,
        q,
        sink,
        swa_cache,
        comp_cache=None,
        topk=None,
        kv=None,
        states=None,
    ):
        if plan.layout != self.layout:
            raise ValueError(f"a step plan for layout {plan.layout} given to a layer of layout {self.layout}")
        if kv is not None:
            written = plan.swa_write_slots >= 0
            swa_cache[plan.swa_write_slots[written]] = kv[written].to(swa_cache.dtype)
        if states is not None and self.rho >= 1:
            written = plan.comp_write_slots >= 0
            comp_cache[plan.comp_write_slots[written]] = states[written].to(comp_cache.dtype)
        layer = self._port_layer(q, sink, plan.window)
        order = plan.order
        rows = order.numel()
        if self.rho >= 1 and layer.is_index_source:
            # Only an index source's indexer writes the model-wide buffer; the
            # other layers read what the latest index source below them left.
            buffer = layer.topk_indices_buffer
            width = padded_topk_width(topk.shape[1])
            if width > buffer.shape[1]:
                raise ValueError(
                    f"top-k {topk.shape[1]} wider than the model's topk_indices_buffer ({buffer.shape[1]})"
                )
            buffer[:rows].fill_(-1)
            buffer[:rows, : topk.shape[1]] = topk[order].to(torch.int32)
        head_dim = q.shape[2]
        layer.swa_cache_layer.kv_cache = self._swa_pages(swa_cache, plan, head_dim)
        comp = None
        if self.rho >= 1:
            comp, shift = self._mirror(comp_cache, self.bs)
            if shift != plan.pool_shift:
                # The step's one metadata object: its table moves into the pool once, for every layer.
                kv_pool.shift_table(plan.compressed.block_table, shift - plan.pool_shift)
                plan.pool_shift = shift
        output = torch.zeros((rows, layer.padded_heads, head_dim), dtype=torch.bfloat16, device=q.device)
        with cuda_query_stand_ins(), self._forward_context(layer, plan, comp), self.impl.calling(layer):
            layer.forward_mqa(q[order].to(torch.bfloat16), None, None, output)
        result = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        result[order] = output[:, : q.shape[1]].to(q.dtype)
        return result
