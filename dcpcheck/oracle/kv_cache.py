"""What a packed KV cache record gives back when read: the values the oracle reads.

An implementation whose layer stores its caches in a packed record declares
it (``Conventions.kv_cache_format``); the suite then draws its latents and
states as that record stores them, so the float64 oracle reads exactly what
the layer's kernel reads and the tolerances stay those of the layer's compute
(docs/CONTRACT.md §8). Plain torch, from the format's definition alone: the
bytes are the implementation's business, never read here.

``fp8_ds_mla`` (vLLM's DeepSeek-V4 record, docs/dsv41.md): a row of head dim
D (a multiple of 8) is rounded to bf16, as the writer's input is; its last
D/8 dims (the "rope" part) are kept in bf16; its first 7D/8 dims (the "nope"
part) are 7 tiles of D/8 dims, each stored as fp8 e4m3 (round to nearest
even, saturating at 448) times a power-of-two scale 2^ceil(log2(amax / 448)),
amax the tile's largest magnitude floored at 1e-4. At D = 512 that is vLLM's
record: 448 nope dims in tiles of 64, 64 rope dims.
"""

from __future__ import annotations

import torch

KV_CACHE_FORMATS = ("fp8_ds_mla",)
FP8_MAX = 448.0  # largest finite e4m3 magnitude
AMAX_FLOOR = 1e-4  # an all-zero tile still gets a finite scale
FP8_DS_MLA_TILES = 7  # nope tiles of D/8 dims each; the rope part is the last D/8


def stored_values(rows: torch.Tensor, kv_cache_format: str) -> torch.Tensor:
    """``rows [..., D]`` as a cache of ``kv_cache_format`` gives them back (same dtype)."""
    if kv_cache_format != "fp8_ds_mla":
        raise ValueError(f"kv_cache_format={kv_cache_format!r}; accepted: {KV_CACHE_FORMATS}")
    head_dim = rows.shape[-1]
    if head_dim % 8:
        raise ValueError(f"fp8_ds_mla needs a head dim that is a multiple of 8, got {head_dim}")
    tile = head_dim // 8
    x = rows.to(torch.bfloat16).float()
    nope = x[..., : FP8_DS_MLA_TILES * tile].unflatten(-1, (FP8_DS_MLA_TILES, tile))
    amax = nope.abs().amax(dim=-1, keepdim=True).clamp_min(AMAX_FLOOR)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    codes = (nope / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    nope = (codes.float() * scale).flatten(-2)
    return torch.cat([nope, x[..., FP8_DS_MLA_TILES * tile :]], dim=-1).to(rows.dtype)
