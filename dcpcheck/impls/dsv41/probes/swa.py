"""Where the tree keeps the sliding-window cache under DCP, against where the port reads it."""

from __future__ import annotations

import sys
import types

import torch

from dcpcheck.impls.dsv41.server.layer import attention_base
from dcpcheck.impls.dsv41.tree.loading import PortTree


def swa_finding(tree: PortTree) -> str | None:
    """Is the tree's sliding-window cache stored as the port reads it (replicated on every DCP rank)?"""
    cls = getattr(tree.module({}), tree.spec.cls)
    swa_cls = sys.modules[attention_base(cls).__module__].DeepseekV4SWACache
    cache = swa_cls.__new__(swa_cls)
    cache.__dict__.update(
        bounded_replay=False,
        block_size=32,
        head_dim=512,
        dtype=torch.bfloat16,
        window_size=128,
        cache_config=types.SimpleNamespace(cache_dtype="auto"),
        packed_bytes_per_token=584,
        packed_page_alignment=576,
        packed_block_stride_alignment=None,
    )
    spec = swa_cls.get_kv_cache_spec(cache, None)
    if not getattr(spec, "dcp_sharded", False):
        return None
    return (
        f"the sliding-window cache is DCP-sharded in the tree: {swa_cls.__module__}.{swa_cls.__name__}."
        f"get_kv_cache_spec builds a {type(spec).__name__} with dcp_sharded=True (AttentionSpec's default, "
        "vllm/v1/kv_cache_interface.py), which vLLM 0.33.0 refuses under DCP (SlidingWindowSpec."
        "max_memory_usage_bytes: 'DCP not support sliding window'), while the port reads the window replicated "
        "(_run_sm120_dcp attends it on DCP rank 0; SWA-only layers keep the DCP1 path)"
    )
