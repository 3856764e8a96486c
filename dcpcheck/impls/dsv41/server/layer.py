"""The real DCP2 attention layer of a vLLM tree, built without weights and
driven the way vLLM's model runner drives it.

Building: the layer's own ``__init__`` runs (its DCP block: head checks, the
DCP group, the combine switch, ``CPTritonContext``) on top of
``DeepseekV4Attention.__init__`` cut short: the tree's own code runs up to
the attention sink, so the layer's compress ratio (and the tree's check of
it), its kv and index sources and its heads are the tree's, read from a
DSV4.1 config (:mod:`dcpcheck.scenarios.topology`); where it would build
weights and CUDA events, which cannot run without CUDA and checkpoint
shapes, a weightless rest sets what that base class (and the DCP2 stack's
version of it) gives the layer: the padded sink, ``dcp_world_size`` /
``dcp_rank`` / ``cp_kv_cache_interleave_size`` (in tokens, vLLM's unit), the
model-wide ``topk_indices_buffer`` and the compressed cache's prefix (the
tree's ``_replace_layer_index``). The metadata builder's ``__init__`` (the
stage gate) runs on a weightless base.

Driving (:class:`PortAttention`): per step and KV layout one metadata pair,
shared by every layer of the layout, as vLLM shares it per KV group:

* requests reordered decode-first, padding rows (CUDA-graph padding) after
  the decode rows of a decode-only step, left out of a mixed step;
* the window in SWA pages of DSV4.1's block size, its metadata from the
  tree's SWA builder (:mod:`.swa_pages`);
* block-table rows as wide as vLLM's for ``max_model_len`` (:func:`.serving.block_table_width`: the
  compressed cache's DCP-sharded, ``max_model_len / W``; the window's replicated), unused columns on the
  null page;
* each layer publishes its top-k (global state ids, padded with -1 to the
  port's 128-wide tiles) into the one model-wide ``topk_indices_buffer``
  before its forward, as an index-source layer does;
* bf16 q (the port asserts it) and caches in the layer's ``kv_cache_dtype``
  (vLLM's fp8_ds_mla record, or dcpcheck's bf16 variant: :mod:`.kv_cache_format`),
  mirrored once per suite cache so their addresses stay fixed across layers and steps.

Then the layer is entered where vLLM's model enters it, ``forward_mqa``: its
metadata lookup by cache prefix in the forward context, its compressed cache
through ``kv_cache`` (a kv source) or the static forward context (a reader of
another source's cache), then ``_forward_sparse_impl``: ``_forward_decode`` /
``_forward_prefill`` with the port's helpers and the tree's own vLLM functions.
"""

from __future__ import annotations

import math
import os
import sys
import types

import torch

from dcpcheck.impls.dsv41.kernels.kernel_envelope import envelope_of
from dcpcheck.impls.dsv41.server.coordinator import layer_group
from dcpcheck.impls.dsv41.server.kv_cache_format import FP8_DS_MLA
from dcpcheck.impls.dsv41.tree.loading import BUILDER_CLASS, PortSpecError, PortTree, patched
from dcpcheck.impls.dsv41.tree.sources import DCP_ATTRIBUTES, served_topk_widths
from dcpcheck.spies import environments

# The port passes BLOCK_N=128 to vLLM's filter; only its tiled branch needs widths that are multiples of it, and
# the filter never takes that branch when it counts (sparse_utils.py _remap_tiling: one program a row up to 4096).
TOPK_TILE = 128


def index_topk() -> int:
    """The HF config's index_topk, the top-k buffer's width (nvidia/model.py sizes
    it [max_num_batched_tokens, index_topk]; the metadata builder reads it too).
    A checkpoint value the tree has no default for: the narrowest one vLLM serves
    under DCP (0.33.0's 512)."""
    return served_topk_widths()[0]


NULL_PAGE = 0
COMBINE_ENV = "DSV41_DCP_COMBINE"
PREFILL_GATHER_ENV = "DSV41_DCP_PREFILL_GATHER"


def padded_topk_width(top_k: int) -> int:
    return max(TOPK_TILE, -(-top_k // TOPK_TILE) * TOPK_TILE)


def _config(
    *,
    world_size: int,
    interleave_tokens: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    hf_config=None,
):
    """The fields of a VllmConfig the port and its builder read."""
    ns = types.SimpleNamespace
    return ns(
        parallel_config=ns(
            decode_context_parallel_size=world_size,
            cp_kv_cache_interleave_size=interleave_tokens,
            prefill_context_parallel_size=1,
        ),
        attention_config=ns(use_non_causal=False),
        speculative_config=None,
        scheduler_config=ns(max_num_batched_tokens=max_num_batched_tokens),
        model_config=ns(max_model_len=max_model_len, hf_config=hf_config),
        quant_config=None,
        cache_config=None,
    )


def _hf_config(topology, *, local_heads: int, head_dim: int, window: int):
    """The fields of a DSV4.1 HF config that ``DeepseekV4Attention.__init__`` reads before its weights."""
    return types.SimpleNamespace(
        compress_ratios=list(topology.compress_ratios),
        kv_source_layer_ids=list(topology.kv_source_layer_ids),
        index_source_layer_ids=list(topology.index_source_layer_ids),
        num_hidden_layers=len(topology.compress_ratios),
        num_attention_heads=local_heads,  # tensor parallel size 1: every head of the config is local
        hidden_size=local_heads * head_dim,
        q_lora_rank=1,
        o_lora_rank=1,
        head_dim=head_dim,
        qk_rope_head_dim=0,
        o_groups=1,
        sliding_window=window,
        rms_norm_eps=1e-6,
    )


class _WeightsReached(Exception):
    """Raised where the tree's ``DeepseekV4Attention.__init__`` starts on the attention sink: what
    it computed before (heads, compress ratio, kv and index sources) is the tree's topology."""


def _stop_at_weights(*args, **kwargs):
    raise _WeightsReached


def attention_base(cls):
    """The tree's DeepseekV4Attention among the bases of its attention class."""
    return next(klass for klass in cls.__mro__[1:] if klass.__name__ == "DeepseekV4Attention")


def _run_tree_init_head(tree_init, layer, vllm_config, prefix: str, topk_indices_buffer, group) -> None:
    """The tree's ``DeepseekV4Attention.__init__`` on ``layer``, up to the attention sink
    (its DCP group, should it ask for one, ``group``)."""
    base_module = sys.modules[tree_init.__module__]
    dcp_group = {"get_dcp_group": lambda: group} if hasattr(base_module, "get_dcp_group") else {}
    with patched(
        base_module, get_tensor_model_parallel_world_size=lambda: 1, make_attention_sink=_stop_at_weights, **dcp_group
    ):
        try:
            tree_init(layer, vllm_config, prefix, topk_indices_buffer)
        except _WeightsReached:
            return
    raise PortSpecError(
        f"{tree_init.__module__}.DeepseekV4Attention.__init__ never called make_attention_sink: dcpcheck reads "
        "the layer's topology from the code before it and cannot build this tree's layer weightless"
    )


def _init_head_layer(tree: PortTree, rho: int):
    """A bare layer of compress ratio ``rho`` (its own kv and index source) after the tree's
    ``DeepseekV4Attention.__init__`` up to the sink; raises what that ``__init__`` raises."""
    cls = getattr(tree.module({}), tree.spec.cls)
    sources = (0,) if rho else ()
    topology = types.SimpleNamespace(
        compress_ratios=(rho,), kv_source_layer_ids=sources, index_source_layer_ids=sources
    )
    config = _config(
        world_size=1,
        interleave_tokens=1,
        max_num_batched_tokens=1,
        max_model_len=1,
        hf_config=_hf_config(topology, local_heads=8, head_dim=64, window=8),
    )
    layer = cls.__new__(cls)
    single = types.SimpleNamespace(world_size=1, rank_in_group=0, device=torch.device("cpu"))
    _run_tree_init_head(attention_base(cls).__init__, layer, config, "model.layers.0.attn", None, single)
    return layer


def tree_refusal(tree: PortTree, rho: int) -> str | None:
    """What the tree's ``DeepseekV4Attention.__init__`` says of a layer of compress ratio ``rho``, or None."""
    try:
        _init_head_layer(tree, rho)
    except ValueError as exc:
        return str(exc)
    return None


def tree_dcp_attributes(tree: PortTree) -> set[str]:
    """Which of the DCP attributes the port reads the tree's ``DeepseekV4Attention.__init__`` sets."""
    layer = _init_head_layer(tree, 1)
    return {name for name in DCP_ATTRIBUTES if name in vars(layer)}


def check_stage_gate(tree: PortTree, group, *, world_size: int) -> None:
    """Run the port's metadata-builder ``__init__``: the stage gate."""
    module = tree.module(dict(os.environ))
    builder_cls = getattr(module, BUILDER_CLASS)
    parent = builder_cls.__mro__[1]
    config = _config(
        world_size=world_size,
        interleave_tokens=1,
        max_num_batched_tokens=1,
        max_model_len=1,
    )

    def weightless_builder_init(self, *args, **kwargs):
        self.vllm_config = config

    with patched(parent, __init__=weightless_builder_init):
        builder_cls(None, [], config, group.device)


def _cache_dtypes(layer, base_module, kv_cache_dtype: str) -> tuple[str, torch.dtype]:
    """The layer's ``kv_cache_dtype`` and ``kv_cache_torch_dtype`` (set after the weights, in
    ``DeepseekV4Attention.__init__``): fp8_ds_mla as the tree resolves vLLM's default
    ``--kv-cache-dtype auto`` for this class (``_resolve_dsv4_kv_cache_dtype``), or dcpcheck's bf16 variant."""
    if kv_cache_dtype != FP8_DS_MLA:
        return kv_cache_dtype, torch.bfloat16
    resolved = base_module._resolve_dsv4_kv_cache_dtype(
        layer._uses_fp8_ds_mla_layout(), "auto", None, layer.packed_kv_cache_dtype
    )
    if resolved != (FP8_DS_MLA, torch.uint8):
        raise PortSpecError(
            f"{type(layer).__name__} resolves --kv-cache-dtype auto to {resolved}, where dcpcheck writes "
            f"{FP8_DS_MLA} caches; run --dcp-impl dsv41...@bfloat16 for plain rows"
        )
    return resolved


class LayerSpec:
    """What the weightless base ``__init__`` gives one layer. ``topology``: the
    DSV4.1 config (``compress_ratios``, ``kv_source_layer_ids``,
    ``index_source_layer_ids``) the layer ``layer_id`` belongs to; None: a
    model of that one layer, its own kv and index source."""

    def __init__(
        self,
        *,
        layer_id,
        rho,
        bs,
        interleave,
        world_size,
        rank,
        local_heads,
        head_dim,
        window,
        sink,
        topk_buffer,
        max_num_batched_tokens,
        max_model_len,
        topology=None,
        kv_cache_dtype=FP8_DS_MLA,
    ):
        self.__dict__.update(locals())
        del self.__dict__["self"]
        if topology is None:
            sources = (0,) if rho else ()
            self.layer_id = 0
            self.topology = types.SimpleNamespace(
                compress_ratios=(rho,), kv_source_layer_ids=sources, index_source_layer_ids=sources
            )


def build_port_layer(
    tree: PortTree,
    group,
    spec: LayerSpec,
    *,
    backend: str,
    prefill_token_chunk: int | None,
    prefill_gather: bool | None = None,
):
    """The tree's attention class, its own ``__init__`` run on the tree's
    ``DeepseekV4Attention.__init__`` cut short at the weights. ``prefill_gather``
    picks the module imported with DSV41_DCP_PREFILL_GATHER=1 or 0. A compress
    ratio or topology the tree refuses raises its ValueError."""
    overrides = {COMBINE_ENV: backend}
    if prefill_gather is not None:
        overrides[PREFILL_GATHER_ENV] = "1" if prefill_gather else "0"
    module = tree.module(dict(os.environ, **overrides))
    cls = getattr(module, tree.spec.cls)
    base = attention_base(cls)
    base_module = sys.modules[base.__module__]
    tree_init = base.__init__
    interleave_tokens = spec.interleave * max(spec.rho, 1)
    config = _config(
        world_size=spec.world_size,
        interleave_tokens=interleave_tokens,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_model_len=spec.max_model_len,
        hf_config=_hf_config(spec.topology, local_heads=spec.local_heads, head_dim=spec.head_dim, window=spec.window),
    )

    dcp_group = layer_group(group)  # the tree's GroupCoordinator over the test's process group (.dcp_group)

    def weightless_init(self, vllm_config, prefix, topk_indices_buffer=None, **kwargs):
        _run_tree_init_head(tree_init, self, vllm_config, prefix, topk_indices_buffer, dcp_group)
        sink = torch.full((self.padded_heads,), -math.inf, dtype=torch.float32, device=group.device)
        sink[: spec.local_heads] = spec.sink.float()
        self.attn_sink = torch.nn.Parameter(sink, requires_grad=False)
        self.topk_indices_buffer = topk_indices_buffer
        self.max_num_batched_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.kv_cache_dtype, self.kv_cache_torch_dtype = _cache_dtypes(self, base_module, spec.kv_cache_dtype)
        self._o_proj_block_size = 128
        self.compressed_cache_prefix = (
            None if self.compress_ratio == 0 else base_module._replace_layer_index(prefix, self.kv_source_layer_id)
        )
        self.swa_cache_layer = types.SimpleNamespace(kv_cache=None, prefix=f"{prefix}.swa_cache")
        # What the DCP2 stack's base class adds (vLLM's own units), where the tree's has not set it.
        dcp = {
            "dcp_world_size": group.world_size,
            "dcp_rank": group.rank_in_group,
            "cp_kv_cache_interleave_size": vllm_config.parallel_config.cp_kv_cache_interleave_size,
        }
        for name in DCP_ATTRIBUTES:
            if name not in vars(self):
                setattr(self, name, dcp[name])

    # The fp8 einsum recipe asserts a CUDA device; the reference kernel needs none.
    replacements = {
        "get_dcp_group": lambda: dcp_group,
        "compute_fp8_einsum_recipe": lambda block_size=128: ((1, 1, block_size), True),
    }
    import vllm.utils.flashinfer as flashinfer_utils

    # vLLM's init check answered by the pinned FlashInfer's dispatch envelope, executed from its source.
    config_check = {"has_flashinfer_sparse_mla_sm120_config": envelope_of(tree.flashinfer.sources).vllm_admits}
    with (
        patched(base, __init__=weightless_init),
        patched(module, **{k: v for k, v in replacements.items() if hasattr(module, k)}),
        patched(flashinfer_utils, **config_check),
        environments(overrides),
    ):
        layer = cls(
            config,
            f"model.layers.{spec.layer_id}.attn",
            topk_indices_buffer=spec.topk_buffer,
        )
    if prefill_token_chunk is not None:
        layer.DCP_PREFILL_TOKEN_CHUNK = prefill_token_chunk
    else:
        layer.DCP_PREFILL_TOKEN_CHUNK = spec.max_num_batched_tokens
    return layer, module
