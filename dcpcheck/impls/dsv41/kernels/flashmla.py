"""FlashMLA's sparse decode computing the SM120 entry's call: the one adapter
from FlashInfer's SM120 conventions to FlashMLA's ``flash_mla_with_kvcache``.

It takes the arguments :func:`.reference.sparse_attention_with_lse` takes (the
entry's after FlashInfer's own normalisation: ``query`` ``[T, H, 512]`` bf16,
each segment's paged cache, ``[T, N]`` slots and ``[T]`` lengths, ``sinks``,
``out`` and a base-2 ``lse`` ``[T, H]``) and computes them with FlashMLA. Each
mapping, with where each side defines it (``flash_mla/flash_mla_interface.py``
of ``sgl-flash-mla`` 1.0.0, ``flash_mla_with_kvcache``'s docstring and body;
vLLM 0.33.0's ``models/deepseek_v41/nvidia/flashmla.py``
``DeepseekV4FlashMLAAttention._forward_decode``, the SM90/SM100 serving call):

* segments: the window segment is ``k_cache``/``indices``/``topk_length``, the
  compressed one ``extra_k_cache``/``extra_indices_in_kvcache``/``extra_topk_length``
  (as ``_forward_decode`` passes them); a cache gets its head axis
  (``unsqueeze(-2)``: ``[blocks, page, 1, bytes]``), the slots a query axis
  (``[T, 1, N]``, ``view(num_decode_tokens, 1, -1)``), both int32;
* the record: vLLM's 584-byte V4 ``fp8_ds_mla`` record is FlashMLA's
  ``kv_format="V4"``, served by the legacy ops only (``use_legacy=True``:
  ``flash_mla/_loader.py``, "the V3.2 / V3.2-no-RoPE / V4 KV cache formats");
* lengths: ``topk_length``/``extra_topk_length`` "only the leftmost topk_length
  indices will be processed", the SM120 ``lens``; none given: the whole width;
* ``-1``: both treat exactly ``-1`` as invalid; FlashMLA "performs no
  upper-bound check", so a read slot outside ``[-1, slots)`` is refused here
  (the reference kernel refuses one past the end too), and an unread one
  outside the cache is made ``-1`` (FlashMLA would still form its address);
* the width: padded with ``-1`` to a multiple of 128, vLLM's
  ``round_up(top_k + window_size, 128)`` (``forward_mqa``, ``_forward_prefill``);
* heads: FlashMLA takes 64 or 128 (``get_padded_num_q_heads``), the entry
  8 to 128: q zero-padded (``attention.py``, ``F.pad`` to ``padded_heads``),
  the padding heads' sink ``-inf`` (``make_attention_sink``: "-inf padding");
* the sink: ``attn_sink`` scales the output by ``exp(lse) / (exp(lse) + exp(sink))``
  and "has no affect on the returned softmax_lse"; the entry's LSE includes it;
* the LSE: FlashMLA's ``softmax_lse`` ``[T, heads, 1]`` is natural-log; the
  entry's is base 2 (``flashinfer/mla/_sparse_mla_sm120/_api.py``), so
  ``lse2 = logaddexp(lse_e, sink) / ln 2``; a row with no candidate is
  ``-inf`` before the sink (FlashMLA's own value there is not the contract's).

Only the production record computes here: head dim 512 and 584 bytes a token
(:func:`applies`); the scaled-down records of the CPU profile stay with the
reference kernel (:mod:`.selection`).
"""

from __future__ import annotations

import math

import torch

from dcpcheck.impls.dsv41.kernels.reference import KernelContractError
from dcpcheck.impls.dsv41.server.kv_cache_format import Fp8DsMlaRecord

DISTRIBUTION = "sgl-flash-mla"
HEAD_DIM = 512  # flash_mla_with_kvcache: "`head_dim` must be 512"
V4_RECORD_BYTES = Fp8DsMlaRecord(HEAD_DIM).bytes_per_token  # 584, kv_format="V4"
KV_FORMAT = "V4"
PADDED_HEADS = (64, 128)  # "`num_heads_q` must be 64 or 128"
WIDTH_MULTIPLE = 128  # vLLM's round_up(..., 128) of the index width


def applies(query: torch.Tensor, *caches: torch.Tensor | None) -> str | None:
    """Why FlashMLA cannot compute this call (None: it can): the production shapes only."""
    if query.shape[-1] != HEAD_DIM:
        return f"head dim {query.shape[-1]}, FlashMLA's is {HEAD_DIM}"
    for cache in caches:
        if cache is not None and (cache.dtype != torch.uint8 or cache.shape[-1] != V4_RECORD_BYTES):
            return (
                f"a {cache.dtype} cache of {cache.shape[-1]} per token, FlashMLA's V4 record is {V4_RECORD_BYTES} bytes"
            )
    if query.shape[1] > PADDED_HEADS[-1]:
        return f"{query.shape[1]} heads, FlashMLA's at most {PADDED_HEADS[-1]}"
    return None


def padded_heads(num_heads: int) -> int:
    """vLLM's ``DeepseekV4FlashMLAAttention.get_padded_num_q_heads``."""
    return PADDED_HEADS[0] if num_heads <= PADDED_HEADS[0] else PADDED_HEADS[1]


def padded_sink(sinks: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """The sink over the padded heads: the padding ``-inf``, which has no effect."""
    if sinks is None:
        return None
    sink = torch.full((heads,), -math.inf, dtype=torch.float32, device=sinks.device)
    sink[: sinks.shape[0]] = sinks.float()
    return sink


def to_sm120_lse(lse_e: torch.Tensor, empty: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """FlashMLA's natural-log LSE without the sink ``[T, H]`` -> the entry's base-2 LSE with it."""
    lse_e = lse_e.masked_fill(empty, -math.inf)
    if sinks is not None:
        lse_e = torch.logaddexp(lse_e, sinks.float()[None, :].expand_as(lse_e))
    return lse_e / math.log(2.0)


def _segment(cache, indices, lens, what: str):
    """-> (cache [blocks, page, 1, bytes], slots [T, 1, N'] int32, lens [T] int32 or None, read [T, N] bool)."""
    num_tokens = indices.shape[0]
    slots = indices.reshape(num_tokens, -1).to(torch.int32)
    width = slots.shape[1]
    read = torch.ones_like(slots, dtype=torch.bool)
    if lens is not None:
        lens = lens.reshape(num_tokens).to(torch.int32)
        if bool((lens > width).any()) or bool((lens < 0).any()):
            raise KernelContractError(f"{what}: a length outside [0, {width}]")
        read = torch.arange(width, device=slots.device)[None, :] < lens[:, None]
    num_slots = cache.shape[0] * cache.shape[1]
    if bool((read & ((slots < -1) | (slots >= num_slots))).any()):
        raise KernelContractError(f"{what}: a read slot outside -1 and [0, {num_slots}) (FlashMLA checks no bound)")
    # Unread entries stay (FlashMLA's lengths are under test: a NaN slot there must weigh nothing),
    # except those outside the cache, whose address FlashMLA would still form.
    slots = slots.masked_fill(~read & ((slots < -1) | (slots >= num_slots)), -1)
    padded = -(-max(width, 1) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
    slots = torch.nn.functional.pad(slots, (0, padded - width), value=-1).contiguous()
    kv = cache if cache.dim() == 4 else cache.unsqueeze(-2)
    return kv, slots.view(num_tokens, 1, padded), lens, read & (slots[:, :width] >= 0)


def sparse_attention_with_lse(
    flash_mla,
    query: torch.Tensor,
    swa_kv_cache: torch.Tensor,
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor | None,
    compressed_kv_cache: torch.Tensor | None,
    extra_indices: torch.Tensor | None,
    extra_lens: torch.Tensor | None,
    out: torch.Tensor,
    sm_scale: float,
    sinks: torch.Tensor | None,
    lse: torch.Tensor,
) -> None:
    """The reference kernel's call, computed by ``flash_mla`` (the module, or a fake of its interface)."""
    problem = applies(query, swa_kv_cache, compressed_kv_cache)
    if problem:
        raise KernelContractError(f"FlashMLA cannot compute this call: {problem}")
    num_tokens, num_heads, _ = query.shape
    heads = padded_heads(num_heads)
    q = torch.nn.functional.pad(query, (0, 0, 0, heads - num_heads)).unsqueeze(1)  # [T, 1, heads, 512]
    k_cache, slots, lens, valid = _segment(swa_kv_cache, swa_indices, swa_lens, "swa indices")
    extra = {}
    if extra_indices is not None:
        if compressed_kv_cache is None:
            raise KernelContractError("extra indices without a compressed cache")
        extra_cache, extra_slots, extra_lens, extra_valid = _segment(
            compressed_kv_cache, extra_indices, extra_lens, "compressed indices"
        )
        extra = dict(extra_k_cache=extra_cache, extra_indices_in_kvcache=extra_slots, extra_topk_length=extra_lens)
        valid = torch.cat([valid, extra_valid], 1)
    metadata, _ = flash_mla.get_mla_metadata()
    flash_out, lse_e = flash_mla.flash_mla_with_kvcache(
        q,
        k_cache,
        None,
        None,
        HEAD_DIM,
        metadata,
        softmax_scale=float(sm_scale),
        is_fp8_kvcache=True,
        indices=slots,
        topk_length=lens,
        attn_sink=padded_sink(sinks, heads),
        use_legacy=True,
        kv_format=KV_FORMAT,
        **extra,
    )
    out.copy_(flash_out[:, 0, :num_heads])
    empty = ~valid.any(1)[:, None].expand(num_tokens, num_heads)
    lse.copy_(to_sm120_lse(lse_e[:, :num_heads, 0], empty, sinks))
