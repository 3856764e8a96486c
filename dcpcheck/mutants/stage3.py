"""Stage-3 mutants: head gather, partial attention, LSE combine.

A bug in port/combine.py also reaches ``dcp_attention`` (port/attention.py),
which calls the combine.
"""

from __future__ import annotations

from functools import partial

from dcpcheck.mutants.patch import Mutant, Patch
from dcpcheck.stages import STAGE_COMBINE, STAGE_TEST_DIRS

combine_mutant = partial(Mutant, stage=STAGE_COMBINE, home=STAGE_TEST_DIRS[STAGE_COMBINE])

MUTANTS = (
    combine_mutant(
        name="GatherHeadsWrongOrder",
        description="q all-gathered on the last dim then reshaped: heads come out h_loc-major, not in TP order",
        patch=Patch(
            "attention.py",
            "return group.all_gather(x, dim=dim)",
            "return group.all_gather(x).reshape(*x.shape[:dim], -1, *x.shape[dim + 1 :])",
        ),
    ),
    combine_mutant(
        name="SinkOnEveryRank",
        description="the attention sink is applied on every rank, so the combine counts exp(sink) W times",
        patch=Patch(
            "attention.py", "swa_cache, swa_slots, sink = None, None, None", "swa_cache, swa_slots = None, None"
        ),
    ),
    combine_mutant(
        name="SinkFoldedAgainAfterMerge",
        description="two sink schemes mixed: rank 0's partial folds the sink, and dcp_attention folds it again "
        "after the merge (as an after_merge port does), so the result counts exp(sink) twice",
        patch=Patch(
            "attention.py",
            "        outputs.append(combine(out, lse, group, backend=backend))\n",
            "        merged, merged_lse = combine(out, lse, group, backend=backend, return_lse=True)\n"
            "        if sink_local is not None:\n"
            "            share = torch.exp2(merged_lse - torch.logaddexp2(merged_lse, sink_local.float() * LOG2_E))\n"
            "            merged = (merged.float() * share[..., None]).to(merged.dtype)\n"
            "        outputs.append(merged)\n",
        ),
    ),
    combine_mutant(
        name="SinkMinusLogWOnEveryRank",
        description="the partial folds sink - ln W on every rank (SGLang's scheme) while the port declares rank0: "
        "the merge is right, every rank's partial is not the declared one",
        patch=Patch(
            "attention.py",
            "    if rank != 0:\n        swa_cache, swa_slots, sink = None, None, None\n",
            "    if sink is not None:\n        sink = sink - math.log(world_size)\n"
            "    if rank != 0:\n        swa_cache, swa_slots = None, None\n",
        ),
    ),
    combine_mutant(
        name="SinkLeftOutOfLse",
        description="the sink divides the output but is left out of the LSE: rank 0's partial gets too little "
        "weight in the merge",
        patch=Patch(
            "attention.py",
            "lse = torch.where(empty, EMPTY_LSE, shift + torch.log2(denominator))",
            "lse = torch.where(empty, EMPTY_LSE, shift + torch.log2(denominator - probs[:, :, -1]))",
        ),
    ),
    combine_mutant(
        name="WindowOnEveryRank",
        description="the replicated SWA window is attended on every rank, so the combine counts it W times",
        patch=Patch("attention.py", "swa_cache, swa_slots, sink = None, None, None", "sink = None"),
    ),
    combine_mutant(
        name="LseBase2ReadAsE",
        description="dcp_attention tells the combine its base-2 partial LSEs are natural (FlashAttention habit)",
        patch=Patch(
            "attention.py",
            "combine(out, lse, group, backend=backend)",
            "combine(out, lse, group, backend=backend, lse_base=math.e)",
        ),
    ),
    combine_mutant(
        name="LseBaseEReadAs2",
        description="combine ignores lse_base: a base-e LSE is merged as if it were base 2",
        patch=Patch(
            "combine.py",
            "combine_backend(out, lse, group, math.log2(lse_base))",
            "combine_backend(out, lse, group, 1.0)",
        ),
    ),
    combine_mutant(
        name="SentinelGivenWeight",
        description="only -inf counts as an empty partial: the -1e30 sentinel row is merged as a real LSE",
        patch=Patch("conventions.py", "EMPTY_LSE_BOUND = -1e28", 'EMPTY_LSE_BOUND = float("-inf")'),
    ),
    combine_mutant(
        name="NoMaxSubtraction",
        description="the merge sums b^lse_r without subtracting the max: overflows (inf/NaN) for LSEs past ~128",
        patch=Patch("combine.py", "shift = tl.where(any_mass, row_max, 0.0)", "shift = tl.zeros_like(row_max)"),
    ),
    combine_mutant(
        name="NanUnderNegInfLse",
        description="ag_rs scales a NaN partial under a -inf LSE by its zero weight: NaN * 0 turns the row NaN",
        patch=Patch(
            "combine.py",
            "scaled = tl.where(weight[:, None] > 0, partial * weight[:, None], 0.0)",
            "scaled = partial * weight[:, None]",
        ),
    ),
    combine_mutant(
        name="ReduceScatterWrongRankOrder",
        description="ag_rs reduce-scatters the head blocks in reverse rank order: rank r keeps rank W-1-r's heads",
        patch=Patch(
            "combine.py",
            "group.reduce_scatter(scaled, dim=0)",
            "group.reduce_scatter(scaled.unflatten(0, (world, -1)).flip(0).flatten(0, 1), dim=0)",
        ),
    ),
    combine_mutant(
        name="ReturnLseAllHeads",
        description="ag_rs with return_lse returns the merged LSE of all H heads instead of this rank's H/W",
        patch=Patch("combine.py", "return merged, merged_lse[:, own].contiguous()", "return merged, merged_lse"),
    ),
    combine_mutant(
        name="A2aSliceToWrongRank",
        description="a2a sends rank j the strided heads j, j+W, ... instead of its block of H/W heads",
        patch=Patch(
            "combine.py",
            "out.view(num_tokens, world, heads_local, head_dim).transpose(0, 1)",
            "out.view(num_tokens, heads_local, world, head_dim).permute(2, 0, 1, 3)",
        ),
    ),
    combine_mutant(
        name="W1NotShortCircuited",
        description="combine at W = 1 runs its collectives and kernels instead of returning the inputs unchanged",
        patch=Patch("combine.py", "    if world == 1:\n        return (out, lse) if return_lse else out\n", ""),
    ),
    combine_mutant(
        name="CollectiveSkippedOnOneRank",
        description="only rank 0 joins the sink all-gather (it alone applies the sinks): the ranks' collectives diverge",
        patch=Patch(
            "attention.py",
            "sink = None if sink_local is None else gather_heads(",
            "sink = None if sink_local is None or group.rank_in_group != 0 else gather_heads(",
        ),
    ),
    combine_mutant(
        name="A2aSumIn16Bit",
        description="a2a rounds each of the W weighted slices to the output dtype before summing them: "
        "bf16/fp16 rounding per rank, not once",
        patch=Patch(
            "combine.py",
            "merged = tl.sum(weighted, axis=0)",
            "merged = tl.sum(weighted.to(merged_ptr.dtype.element_ty).to(tl.float32), axis=0)",
        ),
    ),
    combine_mutant(
        name="AgRsSumIn16Bit",
        description="ag_rs rescales into an out.dtype buffer: each scaled partial rounds to bf16/fp16, summed in it",
        patch=Patch(
            "combine.py",
            "scaled = torch.empty(num_heads, num_tokens, head_dim, dtype=torch.float32, device=out.device)",
            "scaled = torch.empty(num_heads, num_tokens, head_dim, dtype=out.dtype, device=out.device)",
        ),
    ),
    combine_mutant(
        name="A2aRescaleIn16Bit",
        description="a2a rounds each rank's rescale factor b^(lse_r - L) to the output dtype before weighting",
        patch=Patch(
            "combine.py",
            "weights = _rank_weight(lses, shift[None, :], total[None, :], log2_base, empty_bound)",
            "weights = _rank_weight(lses, shift[None, :], total[None, :], log2_base, empty_bound).to(merged_ptr.dtype.element_ty)",
        ),
    ),
    combine_mutant(
        name="AgRsRescaleIn16Bit",
        description="ag_rs rounds the local rescale factor b^(lse_r - L) to the output dtype before weighting",
        patch=Patch(
            "combine.py",
            "weight = _rank_weight(own_lse, shift, total, log2_base, empty_bound)",
            "weight = _rank_weight(own_lse, shift, total, log2_base, empty_bound).to(out_ptr.dtype.element_ty)",
        ),
    ),
    combine_mutant(
        name="LseNarrowedToBf16",
        description="the partial LSEs are narrowed to bf16 on their way to the combine (stored beside the bf16 "
        "partial outputs): each rank's weight 2^(lse_r - L) is off by up to |lse_r| * 2^-8 in the exponent",
        patch=Patch(
            "attention.py",
            "        outputs.append(combine(out, lse, group, backend=backend))\n",
            "        outputs.append(combine(out, lse.to(torch.bfloat16).float(), group, backend=backend))\n",
        ),
    ),
    combine_mutant(
        name="WindowOnEvenRanks",
        description="the window and the sink are attended on every even DCP rank (the rank read within a group of "
        "two): the same as rank 0 alone at W = 2, counted W/2 times from W = 4 on",
        patch=Patch("attention.py", "    if rank != 0:\n", "    if rank % 2 != 0:\n"),
    ),
    combine_mutant(
        name="CacheOffsetInt32",
        description="attention gathers its candidate rows by element offset slot * D computed in int32: past "
        "2^31 elements (a 4 GiB bf16 cache of 512-wide rows) the offset wraps and another row is read",
        patch=Patch(
            "attention.py",
            "        rows = cache[slots.clamp(min=0)].float().masked_fill(missing[:, :, None], 0.0)\n",
            "        width = cache.shape[-1]\n"
            "        offsets = slots.clamp(min=0).int() * width\n"
            "        columns = torch.arange(width, dtype=torch.int32, device=cache.device)\n"
            "        flat = cache.reshape(-1)[(offsets[..., None] + columns).long()]\n"
            "        rows = flat.float().masked_fill(missing[:, :, None], 0.0)\n",
        ),
    ),
)
