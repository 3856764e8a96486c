"""Shape profiles: the sizes a scenario is built at.

The stage tests run at small shapes (fast under the Triton interpreter on
CPU). On CUDA the GPU tests build the same scenarios at a DSV4-Flash-like
profile, so kernels, collectives and tolerances meet the sizes a serving
engine runs: 64 heads of D = 512, a window of 128, top-k 512, 64 states per
page, bf16 outputs with fp32 LSEs, up to 256 decode rows and prefill chunks
of several thousand tokens. Each DeepSeek model has its own: V4.0's at its
compress ratios 4 and 128, V4.1's at its ratios 1 and 2.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dcpcheck.scenarios.batch import KvLayout, StepBatch, build_step_batch
from dcpcheck.scenarios.trace import build_prefill_batch


@dataclass(frozen=True)
class ShapeProfile:
    name: str
    num_heads: int  # H: query heads of the layer, before the DCP split
    head_dim: int  # D: latent width (key = value row, one KV head)
    window: int  # sliding-window tokens, replicated on every rank
    top_k: int  # K: indexer candidates per row
    bs: int  # states per page on one rank
    interleave: int  # S: cp_kv_cache_interleave_size
    dtype: torch.dtype  # q, caches and outputs; LSEs are fp32 always
    decode_rows: dict[int, int]  # rho -> token rows of one decode step batch
    prefill_chunk: int  # rows of the long request's prefill chunk
    # Set: a page holds this many tokens whatever rho, so a compressed page
    # holds page_tokens // rho states (DSV4.1's compressed block size,
    # flashinfer_sparse.py: attn_metadata.block_size // self.compress_ratio).
    page_tokens: int | None = None

    def states_per_page(self, rho: int) -> int:
        return self.page_tokens // rho if self.page_tokens else self.bs

    def layout(self, rho: int, world_size: int) -> KvLayout:
        return KvLayout(rho=rho, bs=self.states_per_page(rho), interleave=self.interleave, world_size=world_size)

    def num_decodes(self, rho: int) -> int:
        """``num_decodes`` that grows :func:`build_step_batch`'s edge-case rows
        (a fixed number) to ``decode_rows[rho]`` rows."""
        edge_rows = build_step_batch(self.layout(rho, 1), top_k=self.top_k, seed=0, num_decodes=0).num_tokens
        return max(self.decode_rows[rho] - edge_rows, 0)

    def decode_batch(self, rho: int, world_size: int, seed: int) -> StepBatch:
        """A mixed decode step: every edge-case row of :func:`build_step_batch`
        plus plain decode requests, ``decode_rows[rho]`` rows in all."""
        layout = self.layout(rho, world_size)
        return build_step_batch(layout, top_k=self.top_k, seed=seed, num_decodes=self.num_decodes(rho))

    def prefill_batch(self, rho: int, world_size: int, seed: int) -> StepBatch:
        """One prefill step whose long request prefills ``prefill_chunk`` rows."""
        return build_prefill_batch(
            self.layout(rho, world_size), top_k=self.top_k, seed=seed, long_chunk=self.prefill_chunk
        )


SMALL = ShapeProfile(
    name="small",
    num_heads=8,
    head_dim=64,
    window=8,
    top_k=16,
    bs=8,
    interleave=2,
    dtype=torch.float32,
    decode_rows={1: 32, 2: 32, 4: 32, 128: 24},
    prefill_chunk=40,
)

# C128A keeps fewer rows: its requests are up to top_k * 128 = 64k tokens
# long, and the scenario's replicated window cache holds every token of every
# request (256 such rows would be ~8 GB per rank).
DSV4_FLASH = ShapeProfile(
    name="dsv4-flash",
    num_heads=64,
    head_dim=512,
    window=128,
    top_k=512,
    bs=64,
    interleave=1,
    dtype=torch.bfloat16,
    decode_rows={4: 256, 128: 32},
    prefill_chunk=4096,
)

# DeepSeek-V4.1: V4-Flash's attention shapes at V4.1's compress ratios 1 and
# 2 (dcpcheck.scenarios.topology), on 64-token pages: 64 and 32 states a page.
DSV41 = dataclasses.replace(DSV4_FLASH, name="dsv4.1", decode_rows={1: 256, 2: 256}, page_tokens=64)

PROFILES = {profile.name: profile for profile in (SMALL, DSV4_FLASH, DSV41)}
# The DeepSeek model -> its realistic profile on CUDA.
REALISTIC = {"v4.0": DSV4_FLASH, "v4.1": DSV41}


def profile_for(device_type: str, model: str = "v4.0") -> ShapeProfile:
    """The realistic profile of ``model`` (a key of REALISTIC) on CUDA, the small one elsewhere."""
    return REALISTIC[model] if device_type == "cuda" else SMALL
