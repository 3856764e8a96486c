"""Where the tree's DSV4.1 indexer refuses DCP, against dcpcheck's model of it, at every W a server boots with."""

from __future__ import annotations

import sys
import types

import torch

from dcpcheck.impls.dsv41.server.layer import attention_base
from dcpcheck.impls.dsv41.tree.loading import PortTree, patched
from dcpcheck.scenarios.topology import Dsv41Topology

# The interleaves the e2e sweep serves at (vLLM's default of 1 token, the
# topology trace's 2, a 64-token page and NIXL's 128) at both compressed ratios.
REFUSAL_GRID = tuple((ratio, tokens) for ratio in (1, 2) for tokens in (1, 2, 64, 128))
# The DCP sizes a server boots with on one host of up to 8 GPUs (those the suite runs), W = 1 included: vLLM's
# runner builds the indexer's metadata builder without DCP too, so a refusal there stops a DCP1 server.
SERVED_WORLD_SIZES = (1, 2, 4, 8)


def indexer_dcp_refusal(tree: PortTree, *, ratio: int, interleave_tokens: int, world_size: int) -> str | None:
    """What the tree's DSV4.1 indexer metadata builder says of serving an index source of
    compress ratio ``ratio`` under DCP ``world_size`` with a ``--cp-kv-cache-interleave-size``
    of ``interleave_tokens``: its ``__init__``'s NotImplementedError, or None if it builds.
    The builder is the one the tree's ``DeepseekV4IndexerCache.get_attn_backend`` picks
    without sparse logits; the runner fields its ``__init__`` reads are stood in."""
    cls = getattr(tree.module({}), tree.spec.cls)
    attention_module = sys.modules[attention_base(cls).__module__]
    builder_cls = attention_module.DeepseekV41IndexerBackend.get_builder_cls()
    builder_module = sys.modules[builder_cls.__init__.__module__]
    ns = types.SimpleNamespace
    config = ns(
        scheduler_config=ns(max_num_batched_tokens=64, max_num_seqs=8),
        parallel_config=ns(
            decode_context_parallel_size=world_size,
            tensor_parallel_size=world_size,
            prefill_context_parallel_size=1,
            cp_kv_cache_interleave_size=interleave_tokens,
        ),
        speculative_config=None,
        num_speculative_tokens=0,
        model_config=ns(max_model_len=4096),
        attention_config=ns(sparse_mla_prefill_workspace_factor=5, resolve_indexer_kv_dtype=lambda default: default),
    )
    spec = attention_module.MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=132, dtype=torch.uint8, tokens_per_state=ratio
    )
    stand_ins = {"get_dcp_group": lambda: ns(rank_in_group=0), "num_compute_units": lambda index: 1}
    with patched(builder_module, **stand_ins):
        try:
            builder_cls(spec, ["indexer"], config, torch.device("cpu"), block_table_width=8)
        except NotImplementedError as exc:
            return f"{builder_cls.__module__}.{builder_cls.__qualname__}.__init__: {exc}"
    return None


def refusal_finding(tree: PortTree) -> str | None:
    """Does the tree's indexer refuse DCP exactly where dcpcheck's model of vLLM
    (:meth:`Dsv41Topology.dcp_refusal`, which decides the e2e sweep's skips; no refusal without DCP) does,
    at each of :data:`SERVED_WORLD_SIZES`? None if it does."""
    disagreements = []
    for world_size in SERVED_WORLD_SIZES:
        for ratio, tokens in REFUSAL_GRID:
            model = Dsv41Topology((ratio,), (0,), (0,)).dcp_refusal(tokens) if world_size > 1 else None
            tree_answer = indexer_dcp_refusal(tree, ratio=ratio, interleave_tokens=tokens, world_size=world_size)
            if (model is None) != (tree_answer is None):
                said = f"refuses it ({tree_answer})" if tree_answer else "serves it"
                disagreements.append(
                    f"W={world_size}, ratio {ratio}, {tokens}-token interleave: the tree {said}, the model does not"
                )
    if not disagreements:
        return None
    return "dcpcheck's model of vLLM's DCP refusal (dcpcheck/scenarios/topology.py) is not the tree's: " + "; ".join(
        disagreements
    )
