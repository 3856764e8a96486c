"""The caches the dsv41 layer reads: vLLM's ``fp8_ds_mla`` record (the default) or bf16 rows.

``fp8_ds_mla`` is the packed uint8 record vLLM 0.33.0 writes for DeepSeek-V4.1
where FlashInfer's SM120 kernel reads it (every arch but SM100:
``models/deepseek_v41/attention.py`` ``_use_v41_mxfp8_kv_record``; the
layer's ``kv_cache_dtype`` from ``_resolve_dsv4_kv_cache_dtype``, its
``--kv-cache-dtype auto`` resolving to the class's ``packed_kv_cache_dtype``).
Its writers:

* the sliding-window cache: the CUDA op ``fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert``
  (``DeepseekV4Attention``'s KV insert, ``models/deepseek_v41/attention.py``), whose
  Triton twin for the same record is ``quantize_and_insert_k_kernel``
  (``models/deepseek_v41/common/ops/cache_utils.py`` ``quantize_and_insert_k_cache``);
* the compressed cache: ``_rope_quant_insert_kernel``
  (``models/deepseek_v41/common/ops/fused_compress_quant_cache.py`` ``rope_quant_insert``,
  called by ``compressor.py`` ``insert_cache``).

Both write, per page of ``page`` tokens, every token's data first, then every
token's scales (FlashInfer's "footer"): token ``t`` of a page has its 448 nope
dims as fp8 e4m3 at ``t * 576``, its 64 rope dims as bf16 right after them,
and its scales at ``page * 576 + t * 8``: one UE8M0 byte per 64-dim nope tile
(the exponent of the power-of-two scale ``2^ceil(log2(max(amax, 1e-4) / 448))``,
plus 127), then a zero pad byte. A row is 584 bytes wide, the page padded to a
multiple of 576 bytes (``kv_page_alignment``; ``v1/kv_cache_interface.py``
``_apply_alignment_padding``), so a page's stride is not ``page * 584``.

FlashInfer 0.7.2.post1's SM120 kernel reads it as its DSV4 model type (a
512-dim bf16 query and ``kv_scale_format="auto"``, what the seed passes):
``include/flashinfer/attention/sparse_mla_sm120/model/kv_cache_traits.cuh``
``KVCacheTraits<ModelType::DSV4>`` (the footer layout, the page stride from the
tensor's ``stride(0)``), each nope value times its tile's scale
(``model/scale_convert.cuh`` ``ue8m0_to_fp32``: ``2^(byte - 127)``), the rope
dims as bf16; ``flashinfer/mla/_core.py`` ``_check_sm120_dsv4_kv_cache_layout``
takes the cache 3-D ``[pages, page, 584]`` or NHD ``[pages, page, 1, 584]``.

Scaled down to the suite's head dims (64, 72; 512 on the GPU profile): the rope
part is the last D/8 dims, the nope part 7 tiles of D/8 dims, so a token has
``7D/8 + 2 * D/8`` data bytes, 8 scale bytes, and pages align to the data
bytes. At D = 512 this is vLLM's record byte for byte (``tests/selftest/dsv41/test_fp8_ds_mla_cache.py``
checks it against vLLM's own Triton writers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DS_MLA = "fp8_ds_mla"
BFLOAT16 = "bfloat16"
KV_CACHE_DTYPES = (FP8_DS_MLA, BFLOAT16)  # FP8_DS_MLA: the layer's default; BFLOAT16: dcpcheck's variant
NOPE_TILES = 7
SCALE_BYTES = NOPE_TILES + 1  # one UE8M0 byte per tile, then a zero pad byte
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4  # the writers' fmaxf(amax, 1e-4)
UE8M0_BIAS = 127


class CacheFormatError(ValueError):
    """A head dim, or a cache, that is not an fp8_ds_mla one."""


@dataclass(frozen=True)
class Fp8DsMlaRecord:
    """vLLM's DeepSeek-V4 fp8_ds_mla record at head dim ``head_dim`` (584 bytes at 512)."""

    head_dim: int

    def __post_init__(self):
        if self.head_dim % 8:
            raise CacheFormatError(f"fp8_ds_mla needs a head dim that is a multiple of 8, got {self.head_dim}")

    @property
    def rope_dims(self) -> int:
        return self.head_dim // 8

    @property
    def tile(self) -> int:
        return self.head_dim // 8

    @property
    def nope_dims(self) -> int:
        return NOPE_TILES * self.tile

    @property
    def data_bytes(self) -> int:
        """A token's data: its fp8 nope dims, then its bf16 rope dims (576 at 512)."""
        return self.nope_dims + 2 * self.rope_dims

    @property
    def bytes_per_token(self) -> int:
        return self.data_bytes + SCALE_BYTES

    def page_stride(self, page: int) -> int:
        """A page's bytes: its records, padded to a multiple of the data bytes (vLLM's 576)."""
        return -(-page * self.bytes_per_token // self.data_bytes) * self.data_bytes

    def allocate(self, num_pages: int, page: int, device) -> torch.Tensor:
        """An empty cache as the layer is bound to it: ``[pages, page, bytes_per_token]`` uint8
        over padded pages (stride ``(page_stride, bytes_per_token, 1)``)."""
        stride = self.page_stride(page)
        raw = torch.zeros(num_pages * stride, dtype=torch.uint8, device=device)
        return raw.as_strided((num_pages, page, self.bytes_per_token), (stride, self.bytes_per_token, 1))

    def _regions(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(data [pages, page, data_bytes], scales [pages, page, SCALE_BYTES]) of a cache
        ``[pages, page, (1,) bytes_per_token]``: each page's bytes from its ``stride(0)``."""
        if cache.dtype != torch.uint8 or cache.shape[-1] != self.bytes_per_token:
            raise CacheFormatError(
                f"an fp8_ds_mla cache of head dim {self.head_dim} is uint8 [..., {self.bytes_per_token}], "
                f"got {cache.dtype} {tuple(cache.shape)}"
            )
        if cache.ndim not in (3, 4) or (cache.ndim == 4 and cache.shape[2] != 1):
            raise CacheFormatError(f"an fp8_ds_mla cache is [pages, page, (1,) bytes], got {tuple(cache.shape)}")
        num_pages, page = cache.shape[0], cache.shape[1]
        if cache.stride(-1) != 1 or cache.stride(1) != self.bytes_per_token:
            raise CacheFormatError(f"fp8_ds_mla rows are packed inside a page; got strides {cache.stride()}")
        pages = cache.as_strided((num_pages, page * self.bytes_per_token), (cache.stride(0), 1))
        data = pages[:, : page * self.data_bytes].unflatten(1, (page, self.data_bytes))
        scales = pages[:, page * self.data_bytes :].unflatten(1, (page, SCALE_BYTES))
        return data, scales

    def write(self, cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """vLLM's writer: ``rows [N, D]`` (rounded to bf16, its input) into ``cache`` at flat ``slots``
        (``page_index * page + offset``)."""
        data, scales = self._regions(cache)
        page = cache.shape[1]
        pages, offsets = slots.long() // page, slots.long() % page
        x = rows.to(torch.bfloat16).float()
        nope = x[:, : self.nope_dims].unflatten(1, (NOPE_TILES, self.tile))
        amax = nope.abs().amax(dim=2, keepdim=True).clamp_min(AMAX_FLOOR)
        exponent = torch.ceil(torch.log2(amax / FP8_MAX))
        codes = (nope * torch.exp2(-exponent)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        rope = x[:, self.nope_dims :].to(torch.bfloat16).contiguous().view(torch.uint8)
        data[pages, offsets] = torch.cat([codes.flatten(1).view(torch.uint8), rope], dim=1)
        # A NaN row (a slot the suite never wrote) gets any scale: its NaN codes read back NaN.
        encoded = (exponent.squeeze(2) + UE8M0_BIAS).clamp(0, 255).nan_to_num(255).to(torch.uint8)
        scales[pages, offsets] = torch.cat([encoded, torch.zeros_like(encoded[:, :1])], dim=1)

    def read(self, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """FlashInfer's reader: the rows at flat ``slots`` (any shape) -> ``[*slots.shape, D]`` fp32."""
        data, scales = self._regions(cache)
        page = cache.shape[1]
        flat = slots.reshape(-1).long()
        record = data[flat // page, flat % page]
        codes = record[:, : self.nope_dims].contiguous().view(torch.float8_e4m3fn).float()
        scale = torch.exp2(scales[flat // page, flat % page, :NOPE_TILES].float() - UE8M0_BIAS)
        nope = (codes.unflatten(1, (NOPE_TILES, self.tile)) * scale[:, :, None]).flatten(1)
        rope = record[:, self.nope_dims :].contiguous().view(torch.bfloat16).float()
        return torch.cat([nope, rope], dim=1).reshape(*slots.shape, self.head_dim)


def allocate(kv_cache_dtype: str, num_pages: int, page: int, head_dim: int, device) -> torch.Tensor:
    """An empty cache of ``kv_cache_dtype`` as the layer is bound to it: ``[pages, page, C]``."""
    if kv_cache_dtype == FP8_DS_MLA:
        return Fp8DsMlaRecord(head_dim).allocate(num_pages, page, device)
    return torch.empty((num_pages, page, head_dim), dtype=torch.bfloat16, device=device)


def write(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """vLLM's writer of the cache's format: ``rows [N, D]`` at flat ``slots``."""
    if cache.dtype == torch.uint8:
        Fp8DsMlaRecord(rows.shape[-1]).write(cache, slots, rows)
    else:
        page = cache.shape[1]
        cache[slots.long() // page, slots.long() % page] = rows.to(cache.dtype)
