"""Field-bug mutants: the port with one bug that a public DCP bug report had.

docs/field-bugs.md replays 68 public reports (vLLM, SGLang, FlashInfer,
TensorRT-LLM, ...) against the contract and writes a one-line patch of the
port for each root cause it can express. The patches that are not already
catalog bugs are the mutants here; each description carries the report's
link and the root cause, paraphrased.

:data:`PATCH_MUTANTS` maps every patch id of that document to the catalog
mutant that carries it (nine are bugs the catalog had before), and
:data:`EQUIVALENT_PATCHES` names the three that change no output of this
port, with why (they are not mutants: no test can kill them). The document's table is
read by :mod:`dcpcheck.mutants.field_table`.
"""

from __future__ import annotations

from functools import partial

from dcpcheck.mutants.patch import Mutant, Patch
from dcpcheck.stages import E2E_TEST_DIR, STAGE_COMBINE, STAGE_INDEX, STAGE_PREFILL, STAGE_TEST_DIRS

index_mutant = partial(Mutant, stage=STAGE_INDEX, home=STAGE_TEST_DIRS[STAGE_INDEX])
combine_mutant = partial(Mutant, stage=STAGE_COMBINE, home=STAGE_TEST_DIRS[STAGE_COMBINE])
layer_mutant = partial(Mutant, stage=STAGE_COMBINE, home=E2E_TEST_DIR)
prefill_mutant = partial(Mutant, stage=STAGE_PREFILL, home=STAGE_TEST_DIRS[STAGE_PREFILL])

MERGE_CALL = "merged, merged_lse = combine_backend(out, lse, group, math.log2(lse_base))"
PARTIAL_LSE = "lse = torch.where(empty, EMPTY_LSE, shift + torch.log2(denominator))"
PARTIAL_CALL = "return sparse_attention(q, comp_cache, comp_slots, swa_cache, swa_slots, sink, scale=scale)"
WRITE_LOCATE = (
    "mine, slot = _locate_state(position // rho, completes, table_rows, rank, world_size, interleave, bs, max_blocks)"
)
LAYER_FILTER = """\
            world_size=self.world_size,
            rank=self.group.rank_in_group,
            interleave=self.interleave,
        )
        return self.impl.dcp_attention("""

MUTANTS = (
    combine_mutant(
        name="A2aBaseIgnored",
        description="https://github.com/sgl-project/sglang/issues/33064: the a2a path merges every LSE as base 2, "
        "whatever base the kernel wrote",
        patch=Patch("combine.py", "        row_width,\n        log2_base,\n", "        row_width,\n        1.0,\n"),
    ),
    combine_mutant(
        name="BaseFactorTwice",
        description="https://github.com/sgl-project/sglang/pull/33926: the LSE base is converted twice "
        "(in the backend and again at the merge)",
        patch=Patch("combine.py", MERGE_CALL, MERGE_CALL.replace("math.log2(lse_base))", "math.log2(lse_base) ** 2)")),
    ),
    combine_mutant(
        name="PartialLseNatural",
        description="https://github.com/flashinfer-ai/flashinfer/issues/4485: the partial's LSE is natural log "
        "while base 2 is declared",
        patch=Patch(
            "attention.py",
            PARTIAL_LSE,
            "lse = torch.where(empty, EMPTY_LSE, (shift + torch.log2(denominator)) * math.log(2.0))",
        ),
    ),
    combine_mutant(
        name="EmptyLseZero",
        description="https://github.com/vllm-project/vllm/pull/38416: a rank with no KV leaves its LSE at 0, "
        "so the empty shard takes real weight in the merge",
        patch=Patch("attention.py", PARTIAL_LSE, PARTIAL_LSE.replace("EMPTY_LSE,", "0.0,")),
    ),
    combine_mutant(
        name="AttnInfMinusInf",
        description="https://github.com/flashinfer-ai/flashinfer/issues/4051: a row with no candidate "
        "computes exp2(-inf - -inf) = NaN",
        patch=Patch("attention.py", "shift = row_max.masked_fill(empty, 0.0)", "shift = row_max"),
    ),
    combine_mutant(
        name="NanTimesZeroA2a",
        description="https://github.com/vllm-project/vllm/pull/47541: a2a sums NaN * 0 from a rank with no "
        "local KV, so the merged row turns NaN",
        patch=Patch(
            "combine.py",
            "weighted = tl.where(weights[:, :, None] > 0, parts * weights[:, :, None], 0.0)",
            "weighted = parts * weights[:, :, None]",
        ),
    ),
    combine_mutant(
        name="HeadDimNotPadded",
        description="https://github.com/vllm-project/vllm/pull/47541: the combine kernels' column tile is the "
        "head dim itself, not padded to a power of two",
        patch=Patch("combine.py", "block_d = triton.next_power_of_2(head_dim)", "block_d = head_dim"),
    ),
    combine_mutant(
        name="LseViewNotContiguous",
        description="https://github.com/vllm-project/vllm/pull/45426: an LSE handed over as a transposed view "
        "(FlashMLA's [b, h, s]) is read as row-major [T, H]",
        patch=Patch("combine.py", "lse = lse.float().contiguous()", "lse = lse.float()"),
    ),
    combine_mutant(
        name="A2aBufferAliased",
        description="https://github.com/vllm-project/vllm/pull/42884: the a2a receive buffer is the send buffer, "
        "so the exchange reads and writes the same bytes",
        patch=Patch("combine.py", "received = torch.empty_like(send)", "received = send"),
    ),
    combine_mutant(
        name="SinkDropped",
        description="https://github.com/PrimeIntellect-ai/prime-rl/pull/3397: under CP the sink argument is "
        "swallowed and never applied",
        patch=Patch("attention.py", PARTIAL_CALL, PARTIAL_CALL.replace("sink, scale", "None, scale")),
    ),
    combine_mutant(
        name="NoLseReturned",
        description="https://github.com/vllm-project/vllm/pull/54639: the partial attention returns no LSE under DCP",
        patch=Patch("attention.py", PARTIAL_CALL, PARTIAL_CALL + "[0], None"),
    ),
    combine_mutant(
        name="NoQGather",
        description="https://github.com/vllm-project/vllm/issues/50095: q is not all-gathered over heads, "
        "so each rank attends only its local heads",
        patch=Patch("attention.py", "q = gather_heads(q_local[rows], group, dim=1)", "q = q_local[rows]"),
    ),
    combine_mutant(
        name="NoCombine",
        description="https://github.com/vllm-project/vllm/issues/50095: the partials are never merged: each rank "
        "keeps its heads of its own partial",
        patch=Patch(
            "attention.py",
            "outputs.append(combine(out, lse, group, backend=backend))",
            "outputs.append(out.chunk(group.world_size, dim=1)[group.rank_in_group])",
        ),
    ),
    combine_mutant(
        name="GatherReverseRankOrder",
        description="https://github.com/NVIDIA/TensorRT-LLM/pull/10350: the heads are assembled from the ranks "
        "in another order than the TP groups",
        patch=Patch(
            "attention.py",
            "return group.all_gather(x, dim=dim)",
            "return torch.cat(group.all_gather(x, dim=dim).chunk(group.world_size, dim=dim)[::-1], dim=dim)",
        ),
    ),
    index_mutant(
        name="WriteBlockSizeDiffers",
        description="https://github.com/vllm-project/vllm/pull/51031: the write side's slot mapping uses another "
        "block size than the read side",
        patch=Patch("index.py", "        rho,\n        bs,\n", "        rho,\n        bs * world_size,\n"),
    ),
    index_mutant(
        name="WriteInterleaveDiffers",
        description="https://github.com/LMCache/LMCache/pull/4936: the write side takes the block size as the "
        "interleave, the read side the configured S",
        patch=Patch(
            "index.py",
            "        interleave,\n        BLOCK=block,",
            "        bs,\n        BLOCK=block,",
        ),
    ),
    index_mutant(
        name="NoOwnerMask",
        description="https://github.com/vllm-project/vllm/pull/48003: no owner test: every rank reads and writes "
        "states it does not own",
        patch=Patch(
            "index.py",
            "owned = candidate & (state >= 0) & (owner == rank)",
            "owned = candidate & (state >= 0)",
        ),
    ),
    index_mutant(
        name="WriteGlobalSlots",
        description="https://github.com/sgl-project/sglang/issues/36886: the write side uses global slots "
        "(no owner filter, no division by W) against per-rank buffers",
        patch=Patch("index.py", WRITE_LOCATE, WRITE_LOCATE.replace("rank, world_size,", "0, 1,")),
    ),
    index_mutant(
        name="WriteStateOffByOne",
        description="https://github.com/NVIDIA/TensorRT-LLM/pull/17795: the write side locates the state after "
        "the one its position completes",
        patch=Patch("index.py", WRITE_LOCATE, WRITE_LOCATE.replace("(position // rho", "((position + 1) // rho")),
    ),
    layer_mutant(
        name="ReadDcp1OverShards",
        description="https://github.com/local-inference-lab/vllm/pull/72: the layer filters with W = 1 "
        "(a config dropped the DCP size) over a sharded cache",
        patch=Patch(
            "layer.py",
            LAYER_FILTER,
            LAYER_FILTER.replace("self.world_size,", "1,").replace("self.group.rank_in_group,", "0,"),
        ),
    ),
    prefill_mutant(
        name="PagesCeilOffByOne",
        description="https://github.com/vllm-project/vllm/pull/27518: one page too many per rank when a request's "
        "state count is a multiple of bs*W",
        patch=Patch(
            "prefill.py",
            "pages = torch.clamp((states + states_per_virtual_block - 1) // states_per_virtual_block, min=1)",
            "pages = torch.clamp(states // states_per_virtual_block + 1, min=1)",
        ),
    ),
    prefill_mutant(
        name="RemapRowStrideAsWidth",
        description="https://github.com/vllm-project/vllm/pull/46514: the prefill remap takes the top-k row "
        "stride from the row width",
        patch=Patch("prefill.py", "        topk.stride(0),\n", "        top_k,\n"),
    ),
    prefill_mutant(
        name="SubChunkQueriesFromFirst",
        description="https://github.com/vllm-project/vllm/issues/54300: a prefill longer than the token chunk "
        "attends every sub-chunk with the first sub-chunk's queries (short prompts clean, long ones corrupt)",
        patch=Patch(
            "attention.py",
            "q = gather_heads(q_local[rows], group, dim=1)",
            "q = gather_heads(q_local[:step], group, dim=1)",
        ),
    ),
    prefill_mutant(
        name="RemapInterleaveOne",
        description="https://github.com/vllm-project/vllm/issues/56715: the prefill gather's id remap assumes "
        "an interleave of 1 (with 64, token 1 reads the key of token 64)",
        patch=Patch(
            "prefill.py",
            "owner_and_local(offset, world_size, interleave)",
            "owner_and_local(offset, world_size, 1)",
        ),
    ),
)

# docs/field-bugs.md patch id -> the catalog mutant carrying it.
PATCH_MUTANTS: dict[str, str] = {
    "lse-e-read-as-2": "LseBaseEReadAs2",
    "lse-2-read-as-e": "LseBase2ReadAsE",
    "a2a-base-ignored": "A2aBaseIgnored",
    "base-factor-twice": "BaseFactorTwice",
    "partial-lse-natural": "PartialLseNatural",
    "empty-lse-zero": "EmptyLseZero",
    "attn-inf-minus-inf": "AttnInfMinusInf",
    "no-max-subtraction": "NoMaxSubtraction",
    "nan-times-zero-agrs": "NanUnderNegInfLse",
    "nan-times-zero-a2a": "NanTimesZeroA2a",
    "sentinel-not-empty": "SentinelGivenWeight",
    "head-dim-not-padded": "HeadDimNotPadded",
    "lse-view-not-contiguous": "LseViewNotContiguous",
    "a2a-buffer-aliased": "A2aBufferAliased",
    "write-bs-differs": "WriteBlockSizeDiffers",
    "write-interleave-differs": "WriteInterleaveDiffers",
    "owner-mod-w": "OwnerModW",
    "no-owner-mask": "NoOwnerMask",
    "write-global-slots": "WriteGlobalSlots",
    "write-state-off-by-one": "WriteStateOffByOne",
    "padding-rows-read": "PaddedRowsNotZeroed",
    "read-dcp1-over-shards": "ReadDcp1OverShards",
    "sink-every-rank": "SinkOnEveryRank",
    "sink-dropped": "SinkDropped",
    "no-lse-returned": "NoLseReturned",
    "no-q-gather": "NoQGather",
    "no-combine": "NoCombine",
    "gather-reverse-rank-order": "GatherReverseRankOrder",
    "pages-ceil-off-by-one": "PagesCeilOffByOne",
    "pages-no-minimum": "PagesWithoutMinimum",
    "remap-row-stride-as-width": "RemapRowStrideAsWidth",
    "sub-chunk-first-queries": "SubChunkQueriesFromFirst",
    "remap-interleave-one": "RemapInterleaveOne",
}

# Patches that change no output of this port (docs/field-bugs.md note 1): the
# port guards an empty row more than once, so removing one guard is invisible.
EQUIVALENT_PATCHES: dict[str, str] = {
    "attn-finite-mask": "equivalent in this port: the value rows behind -1 are zeroed, so a finite -1e30 mask "
    "still gives out 0 and an LSE in the empty band",
    "combine-zero-divisor": "equivalent in this port: an empty partial's weight is selected to 0 before the "
    "divisor is used, and an all-empty row's LSE is selected to the sentinel",
    "combine-inf-shift": "equivalent in this port: the weights of empty partials are selected to 0, so a -inf "
    "shift never reaches a weight of a rank with mass",
}
