"""A stand-in for FlashInfer's SM120 sparse-MLA kernel where it cannot run.

The DCP2 port calls the kernel through two names of its module:
``_sm120_sparse_attention_with_lse`` (the DCP path, which returns the LSE) and
``flashinfer_trtllm_batch_decode_sparse_mla_dsv4`` (the DCP1 path); both reach
FlashInfer's SM120 entry (:mod:`.flashinfer_stand_in`), where this module's
:func:`sparse_attention_with_lse` computes the kernel's documented contract in plain torch:

* ``query``/``out`` ``[T, H, D]`` bf16; caches paged ``[blocks, block_size, (1,) C]``: vLLM's
  ``fp8_ds_mla`` record (uint8, C its bytes per token), each nope value times its
  tile's scale and the rope dims bf16 (:mod:`.kv_cache_format`), or bf16 rows (C = D);
* candidates as prefix + lengths: row t attends ``indices[t, :lens[t]]`` (flat
  slots ``block * block_size + offset``) of each cache; entries past the length
  are never read, and a ``-1`` marks an invalid slot, which is skipped;
* ``lse`` ``[T, H]`` fp32, base 2, of the ``sm_scale``-scaled logits with the
  sink folded in, and ``out`` divided by the same denominator;
* a row with no candidate and no sink: ``out = 0``, ``lse = -inf``.

The last two are FlashInfer's (0.7.2.post1, vLLM 0.33.0's pin, and 0.7.4), from its sparse-MLA SM120 paged attention
(``flashinfer/mla/_sparse_mla_sm120/_api.py``: "``-1`` marks invalid slots";
"its output is zero and its LSE is ``-inf`` when no sink contributes"); the
seed's own ``_SM120_EMPTY_LSE = -1e29`` and its docstring's ``-1e30`` are not
what that release writes.

It is written from that contract alone, apart from the suite's oracle, so a
bug in one does not hide the same bug in the other.
"""

from __future__ import annotations

import math

import torch

from dcpcheck.impls.dsv41.server.kv_cache_format import Fp8DsMlaRecord

EMPTY_LSE = -math.inf
KERNEL_HEADS = (8, 16, 32, 64, 128)  # h_q the SM120 specializations exist for
ROWS_BYTES = 256 * 2**20  # the fp32 candidate rows gathered at once (temporaries of a few times that besides)


class KernelContractError(ValueError):
    """The caller broke the kernel's input contract."""


def _candidate_rows(cache: torch.Tensor, indices: torch.Tensor, lens: torch.Tensor | None, what: str, head_dim: int):
    """-> (rows [T, N, D] fp32, valid [T, N] bool) of each token's first ``lens`` slots."""
    num_tokens = lens.shape[0] if lens is not None else indices.shape[0]
    slots = indices.reshape(num_tokens, -1).long()
    width = slots.shape[1]
    if lens is None:
        valid = slots >= 0
    else:
        if bool((lens.long() > width).any()):
            raise KernelContractError(f"{what}: a length exceeds the index width {width}")
        valid = (torch.arange(width, device=slots.device)[None, :] < lens.long()[:, None]) & (slots >= 0)
    num_slots = cache.shape[0] * cache.shape[1] if cache.dtype == torch.uint8 else cache.numel() // cache.shape[-1]
    if bool((valid & (slots >= num_slots)).any()):
        raise KernelContractError(f"{what}: a slot is past the end of the cache ({num_slots} rows)")
    slots = slots.clamp(0, num_slots - 1)
    if cache.dtype == torch.uint8:
        rows = Fp8DsMlaRecord(head_dim).read(cache, slots)
    else:
        rows = cache.reshape(num_slots, cache.shape[-1])[slots].float()
    # Entries past the length are never read: whatever their slot holds (NaN included) weighs nothing.
    return rows.masked_fill(~valid[..., None], 0.0), valid


def sparse_attention_with_lse(
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
    """Attention of each query over its SWA and compressed candidates (+ sink), ROWS_BYTES of candidates at a
    time: each row's result is its own, and a served prefill chunk's candidates at once (2048 tokens of 2176 rows
    of 512 fp32) are gigabytes a rank."""
    if query.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
        raise KernelContractError(f"query/out must be bf16, got {query.dtype}/{out.dtype}")
    if query.shape[1] not in KERNEL_HEADS:
        raise KernelContractError(f"h_q={query.shape[1]} has no SM120 specialization; accepted: {KERNEL_HEADS}")
    if extra_indices is not None and compressed_kv_cache is None:
        raise KernelContractError("extra indices without a compressed cache")
    num_tokens = query.shape[0]
    if not num_tokens:
        return
    swa = swa_indices.reshape(num_tokens, -1)
    extra = None if extra_indices is None else extra_indices.reshape(num_tokens, -1)
    candidates = swa.shape[1] + (0 if extra is None else extra.shape[1])
    step = max(1, ROWS_BYTES // max(1, candidates * query.shape[-1] * 4))
    for start in range(0, num_tokens, step):
        part = slice(start, start + step)
        _attend(
            query[part],
            swa_kv_cache,
            swa[part],
            None if swa_lens is None else swa_lens[part],
            compressed_kv_cache,
            None if extra is None else extra[part],
            None if extra_lens is None else extra_lens[part],
            out[part],
            sm_scale,
            sinks,
            lse[part],
        )


def _attend(query, swa_kv_cache, swa_indices, swa_lens, compressed_kv_cache, extra_indices, extra_lens, out,
            sm_scale, sinks, lse) -> None:  # fmt: skip
    """:func:`sparse_attention_with_lse` of some tokens (``[t, N]`` indices), into their ``out`` and ``lse``."""
    head_dim = query.shape[-1]
    rows, valid = _candidate_rows(swa_kv_cache, swa_indices, swa_lens, "swa indices", head_dim)
    if extra_indices is not None:
        extra_rows, extra_valid = _candidate_rows(
            compressed_kv_cache, extra_indices, extra_lens, "compressed indices", head_dim
        )
        rows, valid = (
            torch.cat([rows, extra_rows], 1),
            torch.cat([valid, extra_valid], 1),
        )
    q = query.float()
    log2e = 1.0 / math.log(2.0)
    logits2 = torch.einsum("thd,tnd->thn", q, rows) * (sm_scale * log2e)  # base-2 logits
    logits2 = logits2.masked_fill(~valid[:, None, :], -math.inf)
    if sinks is not None:
        sink2 = (sinks.float() * log2e)[None, :, None].expand(q.shape[0], -1, 1)
        logits2 = torch.cat([logits2, sink2], dim=2)
    peak = logits2.amax(dim=2, keepdim=True)
    empty = torch.isneginf(peak)
    peak = torch.where(empty, torch.zeros_like(peak), peak)
    weights = torch.exp2(logits2 - peak)
    denominator = weights.sum(dim=2, keepdim=True)
    values = weights[..., : rows.shape[1]]
    attended = torch.einsum("thn,tnd->thd", values, rows) / torch.where(empty, 1.0, denominator)
    out.copy_(torch.where(empty, 0.0, attended).to(out.dtype))
    row_lse = (peak + torch.log2(torch.where(empty, 1.0, denominator))).squeeze(2)
    lse.copy_(torch.where(empty.squeeze(2), EMPTY_LSE, row_lse))


def sm120_sparse_attention_with_lse(
    query,
    swa_kv_cache,
    workspace,
    swa_indices,
    swa_lens,
    compressed_kv_cache,
    extra_indices,
    extra_lens,
    out,
    sm_scale,
    sinks,
    lse,
) -> None:
    """The port's ``_sm120_sparse_attention_with_lse`` signature."""
    del workspace
    sparse_attention_with_lse(
        query,
        swa_kv_cache,
        swa_indices,
        swa_lens,
        compressed_kv_cache,
        extra_indices,
        extra_lens,
        out,
        sm_scale,
        sinks,
        lse,
    )
