"""The step's compressed metadata and the caches' block-table widths, from the tree's own code:
its DSV4.1 metadata builder's ``build``, its attention's ``get_kv_cache_spec`` and vLLM's block-table sizing."""

from __future__ import annotations

import types

import torch

from dcpcheck.impls.dsv41.server.layer import attention_base
from dcpcheck.impls.dsv41.tree.loading import BUILDER_CLASS, PortTree


def build_compressed_metadata(
    tree: PortTree,
    *,
    rho: int,
    tokens_per_page: int,
    token_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    num_actual_tokens: int,
    topk_tokens: int,
    for_cudagraph_capture: bool = False,
):
    """The step's ``DeepseekV4FlashMLAMetadata`` from the tree's metadata
    builder's ``build`` (its compressed slot mapping included), or, with
    ``for_cudagraph_capture``, its ``build_for_cudagraph_capture`` (what vLLM's runner
    calls while it captures a graph, ``v1/worker/gpu_model_runner.py`` ``_build_attention_metadata``).
    The builder's state is what its ``__init__`` derives from the KV-cache spec; that
    ``__init__`` needs vLLM's runner, so it is set here."""
    builder_cls = getattr(tree.module({}), BUILDER_CLASS)
    builder = builder_cls.__new__(builder_cls)
    rows = max(int(token_slots.numel()), 1)
    builder.compress_ratio = rho
    builder.pcp_size, builder.pcp_rank = 1, 0
    builder.topk_tokens = topk_tokens
    builder.kv_cache_spec = types.SimpleNamespace(
        block_size=tokens_per_page, num_states=tokens_per_page // rho, tokens_per_state=rho
    )
    builder.req_id_per_token_buffer = torch.empty(rows, dtype=torch.int32, device=token_slots.device)
    builder.compressed_slot_mapping_buffer = torch.empty(rows, dtype=torch.int64, device=token_slots.device)
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    common = types.SimpleNamespace(
        num_reqs=int(seq_lens.numel()),
        num_actual_tokens=num_actual_tokens,
        max_query_len=int(query_lens.max()) if query_lens.numel() else 0,
        max_seq_len=int(seq_lens.max()) if seq_lens.numel() else 0,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        slot_mapping=token_slots,
        block_table_tensor=block_table,
        token_to_req_indices=lambda buffer: token_to_req,
    )
    if for_cudagraph_capture:
        return builder_cls.build_for_cudagraph_capture(builder, common)
    return builder_cls.build(builder, 0, common)


def compressed_cache_spec(tree: PortTree, *, rho: int, tokens_per_page: int):
    """The tree's ``DeepseekV4Attention.get_kv_cache_spec`` (``models/deepseek_v41/attention.py``) of a kv-source
    layer of compress ratio ``rho``, run on what that method reads (its page in tokens is
    ``cache_config.block_size``); bf16 rows: the cache dtype decides the page's bytes, not its states."""
    cls = getattr(tree.module({}), tree.spec.cls)
    holder = types.SimpleNamespace(
        is_kv_source=True,
        kv_cache_dtype="auto",
        kv_cache_torch_dtype=torch.bfloat16,
        head_dim=512,
        compress_ratio=rho,
    )
    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=tokens_per_page))
    return attention_base(cls).get_kv_cache_spec(holder, config)


def block_table_width(spec, *, max_model_len: int, dcp_world_size: int) -> int:
    """A rank's block-table row for a KV group of ``spec``, as vLLM's runner sizes it: the spec's own
    ``max_num_blocks_per_req`` (``v1/kv_cache_interface.py``; ``AttentionSpec``'s is
    ``cdiv(max_len, block_size * W)`` where the cache is DCP-sharded) padded by ``get_block_table_width``
    (``v1/worker/block_table.py``, to a 128-token multiple), as ``gpu_model_runner.py``
    ``may_reinitialize_input_batch`` and ``MultiGroupBlockTable.__init__`` do."""
    from vllm.v1.worker.block_table import get_block_table_width

    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(decode_context_parallel_size=dcp_world_size))
    return get_block_table_width(spec.max_num_blocks_per_req(config, max_model_len), spec.block_size)
