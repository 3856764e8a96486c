"""Which cache record a call of FlashInfer's SM120 sparse-MLA kernel names, against the record its caches hold.

The kernel does not read the record from the cache: its format arguments name it, and a cache
of another record whose width still passes the runner's layout checks is misread, not refused.
What each argument names, in FlashInfer 0.7.2.post1 (vLLM 0.33.0's pin):

* ``kv_cache_format`` (``flashinfer/mla/_core.py``, the entry's ``Literal`` and
  ``_trtllm_batch_decode_sparse_mla_dsv4_sm120``'s ``packed_row_bytes``): ``"fp8"`` the
  584-byte DSV4 record, ``"fp8_dsv41"`` the 528-byte DeepSeek-V4.1 record (all-fp8 K, 32-wide
  UE8M0 groups), ``"fp8_dsv41_fp4_ca"`` that record with 288-byte V41_FP4 compressed rows,
  ``"nvfp4"`` the 384-byte NVFP4 record;
* ``kv_scale_format`` (``flashinfer/mla/_sparse_mla_sm120/_execution.py``
  ``normalize_kv_scale_format``, then ``data/csrc/sparse_mla_sm120/attention_resolve.cu``
  ``resolve_format``): the model type for the query's head dim, at 512 ``"auto"`` DSV4 and
  ``"ue8m0_g32"`` DSV4.1; ``"pow2_fp32"`` and ``"arbitrary_fp32"`` name 576-dim models only,
  so at 512 ``resolve_format`` raises.

The layer's caches hold the DSV4 record (vLLM's ``fp8_ds_mla``: :mod:`..server.kv_cache_format`,
scaled to the case's head dim) or dcpcheck's bf16 variant of it, so a call must name that record
with both arguments: ``kv_cache_format="fp8"`` and ``kv_scale_format="auto"``, what the seed passes.
"""

from __future__ import annotations

import torch

from dcpcheck.impls.dsv41.server.kv_cache_format import Fp8DsMlaRecord

DSV4 = "the DSV4 record (584 bytes a token at head dim 512: vLLM's fp8_ds_mla)"
DSV4_1 = "the DeepSeek-V4.1 record (528 bytes a token: all-fp8 K, 32-wide UE8M0 groups)"
NVFP4 = "the NVFP4 record (384 bytes a token)"
# What each kv_cache_format value names for the main cache (the compressed one's differs for fp8_dsv41_fp4_ca).
CACHE_FORMAT_RECORDS = {"fp8": DSV4, "fp8_dsv41": DSV4_1, "fp8_dsv41_fp4_ca": DSV4_1, "nvfp4": NVFP4}
# _execution.py KV_SCALE_FORMATS, and the record resolve_format picks for a 512-dim query (None: it raises).
SCALE_FORMAT_RECORDS = {"auto": DSV4, "ue8m0_g32": DSV4_1, "pow2_fp32": None, "arbitrary_fp32": None}
HELD_CACHE_FORMAT = "fp8"
HELD_SCALE_FORMAT = "auto"


class RecordFormatError(ValueError):
    """A format argument names another cache record than the caches hold."""


def dsv4_row_bytes(head_dim: int) -> int:
    """The DSV4 record's bytes a token at the case's head dim (584 at 512)."""
    return Fp8DsMlaRecord(head_dim).bytes_per_token


def _held(cache: torch.Tensor, head_dim: int, name: str) -> str:
    """What ``cache`` holds: the DSV4 record (uint8 rows of its width) or dcpcheck's bf16 rows of it."""
    if cache.dtype == torch.bfloat16 and cache.shape[-1] == head_dim:
        return DSV4  # dcpcheck's bf16 variant stands in plain rows for the DSV4 record
    width = dsv4_row_bytes(head_dim)
    if cache.dtype == torch.uint8 and cache.shape[-1] == width:
        return DSV4
    raise RecordFormatError(
        f"{name} is {cache.dtype} rows of {cache.shape[-1]}: neither the DSV4 record at head dim {head_dim} "
        f"(uint8, {width} bytes) nor dcpcheck's bf16 rows of it"
    )


def check_record_formats(
    kv_cache_format: str, kv_scale_format: str, head_dim: int, caches: dict[str, torch.Tensor]
) -> None:
    """Refuse format arguments naming another record than ``caches`` (name: cache) hold, as the
    kernel, which reads the record the arguments name, would misread it."""
    scale = str(kv_scale_format).lower().replace("-", "_")  # normalize_kv_scale_format's spelling
    if scale not in SCALE_FORMAT_RECORDS:
        raise RecordFormatError(
            f"kv_scale_format must be one of {sorted(SCALE_FORMAT_RECORDS)}, got {kv_scale_format!r}"
        )
    if SCALE_FORMAT_RECORDS[scale] is None:
        raise RecordFormatError(
            f"unsupported d_qk=512 with kv_scale_format={scale} (resolve_format: {scale} names a 576-dim model)"
        )
    named = {
        f"kv_cache_format={kv_cache_format!r}": CACHE_FORMAT_RECORDS.get(kv_cache_format),
        f"kv_scale_format={kv_scale_format!r}": SCALE_FORMAT_RECORDS[scale],
    }
    for name, cache in caches.items():
        held = _held(cache, head_dim, name)
        for argument, record in named.items():
            if record != held:
                raise RecordFormatError(
                    f"{argument} names {record}, but {name} holds {held}: the kernel would read it as the "
                    f"record named; the layer's fp8_ds_mla caches take kv_cache_format={HELD_CACHE_FORMAT!r} "
                    f"and kv_scale_format={HELD_SCALE_FORMAT!r}"
                )
