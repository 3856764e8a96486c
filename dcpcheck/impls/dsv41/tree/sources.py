"""Served parameters read from the tree's vLLM source without importing it (its modules import
CUDA kernels or run after the weights, which dcpcheck does not build): the top-k widths vLLM
serves under DCP and DSV4.1's SWA page size."""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

DCP_ATTRIBUTES = ("dcp_world_size", "dcp_rank", "cp_kv_cache_interleave_size")
INDEXER_MODULE = "vllm.model_executor.layers.sparse_attn_indexer"
TOPK_MERGE_CHECK = "_assert_cutedsl_dcp_merge_supported"  # refuses an index_topk it cannot merge under DCP
ATTENTION_MODULE = "vllm.models.deepseek_v41.attention"
SWA_CACHE_CLASS = "DeepseekV4SWACache"  # built by DeepseekV4Attention.__init__ with the SWA page size


class StandInError(ImportError):
    """The tree lacks what dcpcheck reads a served parameter from (a usage error, as a missing module is)."""


def _vllm_source(module: str) -> Path | None:
    """The file of a vLLM module, found without importing its packages (on CUDA they import
    compiled extensions before dcpcheck's stand-ins for them are in place)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)), *module.split(".")[1:]).with_suffix(".py")


@functools.cache
def served_topk_widths() -> tuple[int, ...]:
    """The index_topk widths the tree's DCP top-k merge accepts: the tuple of its ``k not in (...)``
    check, read from the indexer's source (importing it needs CUDA kernels)."""
    path = _vllm_source(INDEXER_MODULE)
    if path is None or not path.is_file():
        raise StandInError(f"no {INDEXER_MODULE} to read the served top-k widths from")
    check = next(
        (node for node in ast.walk(ast.parse(path.read_text())) if getattr(node, "name", None) == TOPK_MERGE_CHECK),
        None,
    )
    for node in ast.walk(check) if check else ():
        if isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.NotIn):
            widths = ast.literal_eval(node.comparators[0])
            if isinstance(widths, tuple) and widths and all(isinstance(width, int) for width in widths):
                return tuple(sorted(widths))
    raise StandInError(
        f"{path}: no {TOPK_MERGE_CHECK} with a 'k not in (widths)' check, where dcpcheck reads the top-k "
        "widths vLLM serves under DCP"
    )


@functools.cache
def swa_block_size() -> int:
    """DSV4.1's SWA page in tokens: the ``block_size`` the tree's ``DeepseekV4Attention.__init__`` builds its
    ``DeepseekV4SWACache`` with (that cache's kv cache spec, so the SWA builder's ``block_size``), read from
    the source: that line runs after the weights, which dcpcheck does not build."""
    path = _vllm_source(ATTENTION_MODULE)
    if path is None or not path.is_file():
        raise StandInError(f"no {ATTENTION_MODULE} to read the SWA page size from")
    attention = next(
        (
            node
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef) and node.name == "DeepseekV4Attention"
        ),
        None,
    )
    for node in ast.walk(attention) if attention else ():
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == SWA_CACHE_CLASS:
            size = next((ast.literal_eval(kw.value) for kw in node.keywords if kw.arg == "block_size"), None)
            if isinstance(size, int) and size > 0:
                return size
    raise StandInError(
        f"{path}: no DeepseekV4Attention building a {SWA_CACHE_CLASS} with a literal block_size, where dcpcheck "
        "reads the SWA page size vLLM serves"
    )
