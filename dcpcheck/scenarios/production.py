"""The production profile: the shapes, lengths and KV pools the real port serves with.

The stage tests run the port scaled down (head dim 64/72, top-k 16 to 512,
requests of a few thousand tokens, caches of a few MB). This profile is what
DeepSeek-V4.1 meets when vLLM serves it under DCP, each value with its source:

========================  ==============================  ===================================================
what                      value                           source
========================  ==============================  ===================================================
head dim                  512                             vLLM 0.33.0 ``models/deepseek_v41/nvidia/flashinfer_sparse.py``
                                                          ``get_supported_head_sizes`` (``[512]``)
KV record                 584 bytes (fp8_ds_mla)          ``models/deepseek_v41/attention.py``
                                                          ``_resolve_dsv4_kv_cache_dtype`` / ``_use_v41_mxfp8_kv_record``
                                                          (the V4 record off SM100; ``kv_cache_format`` at 512)
model heads               64                              DeepSeek-V4.1 (Flash)'s ``num_attention_heads``
                                                          (``dcpcheck.scenarios.profiles.DSV41``)
heads per rank            64 / TP, padded                 ``models/deepseek_v41/attention.py`` ``__init__``
                                                          (``n_local_heads = n_heads // tp_size``,
                                                          ``padded_heads = get_padded_num_q_heads(...)``);
                                                          ``flashinfer_sparse.py`` ``_pad_to_supported_q_heads``
                                                          (8, 16, 32, 64, 128); the seed's ``n_dcp_heads =
                                                          n_local_heads * dcp_world_size``
top-k                     512, 1024, 2048                 ``model_executor/layers/sparse_attn_indexer.py``
                                                          ``_assert_cutedsl_dcp_merge_supported``
SWA page                  32 tokens                       the tree's ``DeepseekV4Attention.__init__``
                                                          (``DeepseekV4SWACache(..., block_size=32)``)
compressed page           128 tokens                      ``flashinfer_sparse.py``
                                                          ``get_supported_kernel_block_sizes`` (``[128]``)
max_model_len             300,000                         the seed's A/B (``shared/seeds/000_...txt``:
                                                          "300K ctx, dcp=2")
MTP rows                  q_len 1 + 4                     a 5-token MTP decode (vLLM #50720, issue 52)
KV pool                   > 2^31 bytes, pages at its top  ``v1/worker/utils.py`` ``allocate_kv_cache``: one
                                                          backing buffer, each layer's block ``b`` at
                                                          ``offset + l * layer_stride + b * block_stride``
                                                          (``v1/kv_cache_interface.py`` ``KVCacheTensor``,
                                                          ``create_kv_cache_views``)
block-table width         vLLM's row at max_model_len     ``v1/worker/block_table.py``
                                                          ``get_block_table_width``
                                                          (``dsv41.server.metadata.block_table_width``)
world sizes               1, 2, 4, 8                      one GPU shared by the ranks (docs/gpu.md)
========================  ==============================  ===================================================

:func:`production_step` builds one served step at a profile: decode
requests with MTP rows at the far end of requests past 2^17 tokens (the
longest reaching ``max_model_len``), and a chunk of a chunked prefill past
2^17. ``SMALL_PRODUCTION`` is the same logic at a small head dim and few
rows, for CPU: positions past 2^17, vLLM's wide block tables, top-k 2048
and a pool past 2^31 bytes with few pages touched.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dcpcheck.scenarios.batch import KvLayout, StepBatch, _BatchBuilder

PROFILE_ENV = "DCPCHECK_PROFILE"  # "production": the production cases run on CPU too
PRODUCTION_CHOICE = "production"
MODEL_HEADS = 64
SUPPORTED_Q_HEADS = (8, 16, 32, 64, 128)  # flashinfer_sparse.py _SPARSE_MLA_SUPPORTED_Q_HEADS
POSITION_MARK = 2**17  # the positions past which the field's DCP reports start (issue 52)
BYTE_OFFSET_MARK = 2**31  # an int32 byte offset wraps here


def padded_heads(num_heads: int) -> int:
    """``flashinfer_sparse.py`` ``_pad_to_supported_q_heads``: the kernel's next head count."""
    for supported in SUPPORTED_Q_HEADS:
        if num_heads <= supported:
            return supported
    raise ValueError(f"{num_heads} heads: the sparse-MLA kernel takes at most {SUPPORTED_Q_HEADS[-1]}")


@dataclass(frozen=True)
class ServedLayout:
    """One TP x DCP layout: ``tp`` GPUs split the heads, ``dcp`` of them the KV."""

    tp: int
    dcp: int
    model_heads: int = MODEL_HEADS

    @property
    def local_heads(self) -> int:
        """``n_local_heads = n_heads // tp_size`` (attention.py), padded as the kernel needs."""
        return padded_heads(self.model_heads // self.tp)

    @property
    def kernel_heads(self) -> int:
        """The heads the kernel sees: gathered over the DCP group (the seed's ``n_dcp_heads``)."""
        return self.local_heads * self.dcp

    @property
    def name(self) -> str:
        return f"TP{self.tp}xDCP{self.dcp}"


# The users' layouts on 2 and 4 GPUs (DCP divides TP: vllm/config/parallel.py), one per W on one GPU;
# W = 1 is TP2 without DCP, W = 8 the 8-GPU layout.
SERVED_LAYOUTS = {
    1: (ServedLayout(tp=2, dcp=1),),
    2: (ServedLayout(tp=2, dcp=2), ServedLayout(tp=4, dcp=2)),
    4: (ServedLayout(tp=4, dcp=4),),
    8: (ServedLayout(tp=8, dcp=8),),
}


@dataclass(frozen=True)
class ProductionProfile:
    name: str
    head_dim: int
    top_ks: tuple[int, ...]
    tokens_per_page: int  # the compressed page in tokens
    max_model_len: int
    speculative_tokens: int  # MTP: decode rows of 1 + this many tokens
    prefill_chunk: int  # rows of the chunked prefill's chunk
    pool_bytes: int  # the compressed KV pool: its used pages sit past BYTE_OFFSET_MARK
    dtype: torch.dtype
    window: int = 128  # DSV4's sliding window (profiles.DSV41)
    heads_per_rank: int | None = None  # None: each W's served layouts; else this many (small profile)

    def layouts(self, world_size: int) -> tuple[ServedLayout, ...]:
        return SERVED_LAYOUTS[world_size]

    def kv_layout(self, rho: int, world_size: int, interleave_tokens: int = 1) -> KvLayout:
        if interleave_tokens % rho:
            raise ValueError(f"an interleave of {interleave_tokens} tokens is not whole states at ratio {rho}")
        return KvLayout(
            rho=rho,
            bs=self.tokens_per_page // rho,
            interleave=interleave_tokens // rho,
            world_size=world_size,
        )


PRODUCTION = ProductionProfile(
    name="production",
    head_dim=512,
    top_ks=(512, 1024, 2048),
    tokens_per_page=128,
    max_model_len=300_000,
    speculative_tokens=4,
    prefill_chunk=128,  # the reference kernel holds [rows, K + window, 512] fp32: 128 rows at K 2048 are 0.6 GB
    pool_bytes=BYTE_OFFSET_MARK + (64 << 20),
    dtype=torch.bfloat16,
)
# The profile's logic where CPU time is scarce: positions past 2^17, vLLM's row widths at that
# max_model_len, top-k 2048 and a pool past 2^31 bytes (torch.empty: only the used pages are touched).
SMALL_PRODUCTION = ProductionProfile(
    name="production-small",
    head_dim=64,
    top_ks=(2048,),
    tokens_per_page=128,
    max_model_len=POSITION_MARK + 4096,
    speculative_tokens=4,
    prefill_chunk=8,
    pool_bytes=BYTE_OFFSET_MARK + (16 << 20),
    dtype=torch.float32,
    window=8,
    heads_per_rank=8,
)
PROFILES = {profile.name: profile for profile in (PRODUCTION, SMALL_PRODUCTION)}


def production_selected(device_type: str) -> bool:
    """The production profile runs on CUDA, and on CPU where ``DCPCHECK_PROFILE=production`` asks."""
    choice = os.environ.get(PROFILE_ENV, "")
    if choice not in ("", PRODUCTION_CHOICE):
        raise ValueError(f"{PROFILE_ENV}={choice!r}: accepted values are {PRODUCTION_CHOICE!r} or unset")
    return device_type == "cuda" or choice == PRODUCTION_CHOICE


def served_table_width(profile: ProductionProfile, world_size: int) -> int:
    """A rank's compressed block-table row as vLLM sizes it at ``max_model_len``: ``AttentionSpec.max_num_blocks_per_req``
    (``v1/kv_cache_interface.py``: ``cdiv(max_len, block_size * dcp_size)``, the cache DCP-sharded), which
    ``get_block_table_width`` (``v1/worker/block_table.py``) leaves as is for a 128-token page (its 128-token
    alignment is one page). The same as ``dsv41.server.metadata.block_table_width`` of the tree's spec."""
    virtual_page = profile.tokens_per_page * world_size
    return -(-profile.max_model_len // virtual_page)


def served_block_table(table: torch.Tensor, width: int, *, seed: int) -> torch.Tensor:
    """``table`` (a rank's rows, as wide as its longest request needs) widened to ``width`` columns, as vLLM's
    row is. The spare columns hold pages no row of the step uses (``v1/worker/block_table.py``
    ``BlockTable.add_row`` writes only a request's own pages), so a read past them gets a real-looking
    slot, neither a crash nor the null page."""
    rows, used = table.shape
    if used > width:
        raise ValueError(f"a request needs {used} pages of a rank, past vLLM's row of {width}: vLLM refuses it")
    first_free = int(table.max()) + 1 if table.numel() else 0
    spare = torch.randperm(rows * (width - used), generator=torch.Generator().manual_seed(seed)) + first_free
    return torch.cat([table, spare.view(rows, width - used).to(table.dtype)], dim=1)


def production_step(profile: ProductionProfile, layout: KvLayout, *, top_k: int, seed: int) -> StepBatch:
    """One served step at ``profile``: decode requests first (vLLM's order), then a prefill chunk.

    * the longest request ends at ``max_model_len`` with an MTP verification (1 + spec tokens rows),
      its top-k the newest states (the last page of every rank's row);
    * a request past 2^17 decodes one row, its top-k the full width;
    * one past 2^17 verifies MTP rows, top-k full / the newest (W = 1) or one rank's ids (W > 1);
    * a chunked prefill's chunk ending past 2^17, then a CUDA-graph-like padding row.

    Rows see more than K states, so the indexer fills every column (DCP1's
    ``compute_global_topk_indices_and_lens``, ``models/deepseek_v41/common/ops/cache_utils.py``, keeps -1
    gaps in place and counts the valid ids: the kernel's prefix then misses ids past a gap; so does the
    port's prefill gather remap); only the DCP decodes get rows of one rank's ids, which the filter compacts.
    """
    rho = layout.rho
    builder = _BatchBuilder(layout, top_k, torch.Generator().manual_seed(seed))
    mtp = 1 + profile.speculative_tokens
    far = POSITION_MARK + 1 + builder.randint(1024)
    longest = builder.add_request(tokens=profile.max_model_len)
    builder.add_rows(longest, ["recent"] * (mtp - 1) + ["full"], role="spec-decode")
    builder.add_rows(builder.add_request(tokens=far + 3 * rho), ["full"], role="decode")
    mixed = ("full", "one-rank" if layout.world_size > 1 else "recent")
    builder.add_rows(builder.add_request(tokens=far), [mixed[i % 2] for i in range(mtp)], role="spec-decode")
    chunked = builder.add_request(tokens=far + 5 * rho)
    patterns = ("full", "recent")  # the gather's remap keeps gaps in place too: prefill rows get the indexer's rows
    builder.add_rows(chunked, [patterns[i % 2] for i in range(profile.prefill_chunk)], role="prefill")
    builder.add_padding_row()
    return builder.build(table_slack=0, table_seed=seed)  # the longest row fills vLLM's row to its last column


def production_trace(profile: ProductionProfile, layout: KvLayout, *, top_k: int, seed: int) -> tuple[StepBatch, ...]:
    """Two served steps of the same requests in the same order (decodes first, as vLLM orders them), the
    second reading states and window rows the first wrote:

    1. the longest request's MTP verification (1 + spec tokens rows) ending that many tokens short of
       ``max_model_len``, a decode past 2^17, a chunked prefill's chunk ending past 2^17, a padding row;
    2. the longest's next verification (ending at ``max_model_len``), the decode's next row, and the
       chunked request's first verification after its chunk, a padding row.

    Step 2's rows read the newest states (and, at W > 1, one rank's ids): those step 1 wrote among them.
    Each step's rows hold the indexer's full rows as :func:`production_step`'s do."""
    rho = layout.rho
    generator = torch.Generator().manual_seed(seed)
    mtp = 1 + profile.speculative_tokens
    far = POSITION_MARK + 1 + int(torch.randint(1024, (1,), generator=generator))
    lengths = (  # each request's tokens after steps 1 and 2
        (profile.max_model_len - mtp, profile.max_model_len),
        (far + 3 * rho, far + 3 * rho + 1),
        (far, far + mtp),
    )
    steps = []
    for step in (0, 1):
        builder = _BatchBuilder(layout, top_k, generator)
        longest, decode, chunked = (builder.add_request(tokens=length[step]) for length in lengths)
        builder.add_rows(longest, ["recent"] * (mtp - 1) + ["full"], role="spec-decode")
        builder.add_rows(decode, ["recent" if step else "full"], role="decode")
        if step == 0:
            patterns = ("full", "recent")
            builder.add_rows(chunked, [patterns[i % 2] for i in range(profile.prefill_chunk)], role="prefill")
        else:
            mixed = ("recent", "one-rank" if layout.world_size > 1 else "full")
            builder.add_rows(chunked, [mixed[i % 2] for i in range(mtp)], role="spec-decode")
        builder.add_padding_row()
        steps.append(builder.build(table_slack=0, table_seed=seed))
    return tuple(steps)
