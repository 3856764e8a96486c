"""The real DCP2 attention layer of a vLLM tree, built without weights and
driven the way vLLM's model runner drives it.

Building: the layer's own ``__init__`` runs (its DCP block: head checks, the
DCP group, the combine switch, ``CPTritonContext``) on top of a weightless
stand-in for ``DeepseekV4Attention.__init__``, which cannot run without CUDA
and checkpoint shapes. The stand-in sets what that base class (and the DCP2
stack's version of it) gives the layer: heads, head dim, window, compress
ratio, the padded sink, ``dcp_world_size`` / ``dcp_rank`` /
``cp_kv_cache_interleave_size`` (in tokens, vLLM's unit) and the model-wide
``topk_indices_buffer``. The metadata builder's ``__init__`` (the stage gate)
runs the same way.

Driving (:class:`PortAttention`): per step and KV layout one metadata pair,
shared by every layer of the layout, as vLLM shares it per KV group:

* requests reordered decode-first, padding rows (CUDA-graph padding) after
  the decode rows of a decode-only step, left out of a mixed step;
* SWA candidates as prefix + lengths ``[T, 1, window]``;
* block tables as wide as ``max_model_len``, unused columns on the null page;
* each layer publishes its top-k (global state ids, padded with -1 to the
  port's 128-wide tiles) into the one model-wide ``topk_indices_buffer``
  before its forward, as an index-source layer does;
* bf16 q and caches (the port asserts bf16 q), the caches mirrored once per
  suite cache so their addresses stay fixed across layers and steps.

Then ``_forward_sparse_impl`` runs: ``_forward_decode`` / ``_forward_prefill``
with the port's helpers and the tree's own vLLM functions.
"""

from __future__ import annotations

import math
import os
import types

import torch

from dcpcheck.impls.dsv41 import reference_kernel
from dcpcheck.impls.dsv41.tree import BUILDER_CLASS, PortTree, patched
from dcpcheck.spies import environments

TOPK_TILE = 128  # the port's filter runs BLOCK_N=128 tiles: top-k widths are multiples of it
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
):
    """The fields of a VllmConfig the port and its builder read."""
    ns = types.SimpleNamespace
    return ns(
        parallel_config=ns(
            decode_context_parallel_size=world_size,
            cp_kv_cache_interleave_size=interleave_tokens,
        ),
        attention_config=ns(use_non_causal=False),
        speculative_config=None,
        scheduler_config=ns(max_num_batched_tokens=max_num_batched_tokens),
        model_config=ns(max_model_len=max_model_len),
    )


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


class LayerSpec:
    """What the weightless base ``__init__`` gives one layer."""

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
    ):
        self.__dict__.update(locals())
        del self.__dict__["self"]


def build_port_layer(
    tree: PortTree,
    group,
    spec: LayerSpec,
    *,
    backend: str,
    prefill_token_chunk: int | None,
    prefill_gather: bool | None = None,
):
    """The tree's attention class, its own ``__init__`` run on a weightless base.
    ``prefill_gather`` picks the module imported with DSV41_DCP_PREFILL_GATHER=1 or 0."""
    overrides = {COMBINE_ENV: backend}
    if prefill_gather is not None:
        overrides[PREFILL_GATHER_ENV] = "1" if prefill_gather else "0"
    module = tree.module(dict(os.environ, **overrides))
    cls = getattr(module, tree.spec.cls)
    base = next(klass for klass in cls.__mro__[1:] if klass.__name__ == "DeepseekV4Attention")
    interleave_tokens = spec.interleave * max(spec.rho, 1)
    config = _config(
        world_size=spec.world_size,
        interleave_tokens=interleave_tokens,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_model_len=spec.max_model_len,
    )

    def weightless_init(self, vllm_config, prefix, topk_indices_buffer=None, **kwargs):
        torch.nn.Module.__init__(self)
        self.vllm_config = vllm_config
        self.prefix = prefix
        self.layer_id = spec.layer_id
        self.n_local_heads = spec.local_heads
        self.n_heads = spec.local_heads * spec.world_size
        self.head_dim = spec.head_dim
        self.window_size = spec.window
        self.compress_ratio = spec.rho
        self.scale = spec.head_dim**-0.5
        self.padded_heads = self.get_padded_num_q_heads(self.n_local_heads)
        sink = torch.full((self.padded_heads,), -math.inf, dtype=torch.float32, device=group.device)
        sink[: spec.local_heads] = spec.sink.float()
        self.attn_sink = torch.nn.Parameter(sink, requires_grad=False)
        self.topk_indices_buffer = topk_indices_buffer
        self.max_num_batched_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.kv_cache_torch_dtype = torch.bfloat16
        self._o_proj_block_size = 128
        self.compressed_cache_prefix = None if spec.rho == 0 else prefix
        self.swa_cache_layer = types.SimpleNamespace(kv_cache=None, prefix=f"{prefix}.swa")
        # What the DCP2 stack's base class adds (vLLM's own units).
        self.dcp_world_size = group.world_size
        self.dcp_rank = group.rank_in_group
        self.cp_kv_cache_interleave_size = vllm_config.parallel_config.cp_kv_cache_interleave_size

    # The fp8 einsum recipe asserts a CUDA device; the reference kernel needs none.
    replacements = {
        "get_dcp_group": lambda: group,
        "compute_fp8_einsum_recipe": lambda block_size=128: ((1, 1, block_size), True),
    }
    import vllm.utils.flashinfer as flashinfer_utils

    config_check = {"has_flashinfer_sparse_mla_sm120_config": reference_kernel.has_sm120_config}
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
