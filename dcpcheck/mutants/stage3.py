"""Stage-3 mutants: head gather, partial attention, LSE combine.

Each buggy copy below is the port's function of the same name in
:mod:`dcpcheck.port.attention` or :mod:`dcpcheck.port.combine` with one line
changed (marked ``# BUG``); a bug in the combine also reaches
``dcp_attention``, which calls it.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist

from dcpcheck.port import triton_env  # noqa: F401  (first: sets TRITON_INTERPRET before triton loads)

import triton
import triton.language as tl

from dcpcheck.mutants.base import Mutant, Swap
from dcpcheck.port import attention as port_attention
from dcpcheck.port import combine as port_combine
from dcpcheck.port.attention import gather_heads, partial_attention, sparse_attention
from dcpcheck.port.combine import (
    EMPTY_LSE,
    EMPTY_LSE_BOUND,
    _check_inputs,
    _combine_a2a,
    _combine_ag_rs,
    _launch_shape,
    _merge_scale,
    _merged_lse,
    _rank_weight,
    _rescale_local_kernel,
    _sum_received_kernel,
    combine,
)
from dcpcheck.stages import STAGE_COMBINE


class CombineMutant(Mutant):
    stage = STAGE_COMBINE
    home = "tests/stage3_combine"


def _gather_heads_default_dim(x: torch.Tensor, group, *, dim: int = 1) -> torch.Tensor:
    return group.all_gather(x).reshape(*x.shape[:dim], -1, *x.shape[dim + 1 :])  # BUG: vLLM's default dim=-1


class GatherHeadsWrongOrder(CombineMutant):
    description = "q all-gathered on the last dim then reshaped: heads come out h_loc-major, not in TP order"
    bug = Swap(port_attention, gather_heads=_gather_heads_default_dim)


def _partial_attention_sink_everywhere(q, comp_cache, comp_slots, swa_cache, swa_slots, sink, *, scale, rank):
    if rank != 0:
        swa_cache, swa_slots = None, None  # BUG: the sink stays on every rank
    return sparse_attention(q, comp_cache, comp_slots, swa_cache, swa_slots, sink, scale=scale)


class SinkOnEveryRank(CombineMutant):
    description = "the attention sink is applied on every rank, so the combine counts exp(sink) W times"
    bug = Swap(port_attention, partial_attention=_partial_attention_sink_everywhere)


def _partial_attention_window_everywhere(q, comp_cache, comp_slots, swa_cache, swa_slots, sink, *, scale, rank):
    if rank != 0:
        sink = None  # BUG: the replicated window stays on every rank
    return sparse_attention(q, comp_cache, comp_slots, swa_cache, swa_slots, sink, scale=scale)


class WindowOnEveryRank(CombineMutant):
    description = "the replicated SWA window is attended on every rank, so the combine counts it W times"
    bug = Swap(port_attention, partial_attention=_partial_attention_window_everywhere)


class LseBase2ReadAsE(CombineMutant):
    description = "dcp_attention tells the combine its base-2 partial LSEs are natural (FlashAttention habit)"
    bug = Swap(port_attention, combine=partial(combine, lse_base=math.e))


def _combine_ignores_base(out, lse, group, *, backend="ag_rs", lse_base=2.0, return_lse=False):
    world = group.world_size
    _check_inputs(out, lse, world, backend, lse_base)
    if world == 1:
        return (out, lse) if return_lse else out
    out = out.contiguous()
    lse = lse.float().contiguous()
    combine_backend = _combine_ag_rs if backend == "ag_rs" else _combine_a2a
    merged, merged_lse = combine_backend(out, lse, group, 1.0)  # BUG: lse_base ignored, base 2 assumed
    return (merged, merged_lse) if return_lse else merged


class LseBaseEReadAs2(CombineMutant):
    description = "combine ignores lse_base: a base-e LSE is merged as if it were base 2"
    bug = Swap(port_combine, combine=_combine_ignores_base)


class SentinelGivenWeight(CombineMutant):
    description = "only -inf counts as an empty partial: the -1e30 sentinel row is merged as a real LSE"
    bug = Swap(port_combine, EMPTY_LSE_BOUND=-math.inf)


@triton.jit
def _merge_scale_no_max(lses_ptr, rows, row_ok, num_rows, log2_base, empty_bound,
                        WORLD: tl.constexpr, WORLD_P2: tl.constexpr):
    ranks = tl.arange(0, WORLD_P2).to(tl.int64)
    mask = (ranks[:, None] < WORLD) & row_ok[None, :]
    lses = tl.load(lses_ptr + ranks[:, None] * num_rows + rows[None, :],
                   mask=mask, other=float("-inf")).to(tl.float32)
    has_mass = lses > empty_bound
    row_max = tl.max(tl.where(has_mass, lses, float("-inf")), axis=0)
    any_mass = row_max > empty_bound
    shift = tl.zeros_like(row_max)  # BUG: no max-subtraction, b^lse overflows fp32
    weights = tl.where(has_mass, tl.exp2((lses - shift[None, :]) * log2_base), 0.0)
    return shift, tl.where(any_mass, tl.sum(weights, axis=0), 1.0), any_mass


class NoMaxSubtraction(CombineMutant):
    description = "the merge sums b^lse_r without subtracting the max: overflows (inf/NaN) for LSEs past ~128"
    bug = Swap(port_combine, _merge_scale=_merge_scale_no_max)


@triton.jit
def _rescale_local_kernel_nan_times_zero(
    out_ptr, own_lse_ptr, lses_ptr, scaled_ptr, merged_lse_ptr,
    num_tokens, num_heads, head_dim, log2_base, empty_bound, empty_lse,
    WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    num_rows = num_tokens * num_heads
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
    row_ok = rows < num_rows
    shift, total, any_mass = _merge_scale(lses_ptr, rows, row_ok, num_rows, log2_base,
                                          empty_bound, WORLD, WORLD_P2)
    tl.store(merged_lse_ptr + rows, _merged_lse(shift, total, any_mass, log2_base, empty_lse),
             mask=row_ok)

    own_lse = tl.load(own_lse_ptr + rows, mask=row_ok, other=float("-inf")).to(tl.float32)
    weight = _rank_weight(own_lse, shift, total, log2_base, empty_bound)
    cols = tl.arange(0, BLOCK_D).to(tl.int64)
    tile_ok = row_ok[:, None] & (cols[None, :] < head_dim)
    partial = tl.load(out_ptr + rows[:, None] * head_dim + cols[None, :],
                      mask=tile_ok, other=0.0).to(tl.float32)
    scaled = partial * weight[:, None]  # BUG: NaN * 0 = NaN under a -inf LSE
    head_major_rows = (rows % num_heads) * num_tokens + rows // num_heads
    tl.store(scaled_ptr + head_major_rows[:, None] * head_dim + cols[None, :], scaled,
             mask=tile_ok)


class NanUnderNegInfLse(CombineMutant):
    description = "ag_rs scales a NaN partial under a -inf LSE by its zero weight: NaN * 0 turns the row NaN"
    bug = Swap(port_combine, _rescale_local_kernel=_rescale_local_kernel_nan_times_zero)


def _combine_ag_rs_reversed_ranks(out, lse, group, log2_base):
    num_tokens, num_heads, head_dim = out.shape
    world, rank = group.world_size, group.rank_in_group
    lses = group.all_gather(lse, dim=0).view(world, num_tokens, num_heads)
    scaled = torch.empty(num_heads, num_tokens, head_dim, dtype=torch.float32, device=out.device)
    merged_lse = torch.empty(lse.shape, dtype=torch.float32, device=out.device)
    grid, block_rows, block_d = _launch_shape(num_tokens * num_heads, head_dim)
    _rescale_local_kernel[grid](
        out, lse, lses, scaled, merged_lse,
        num_tokens, num_heads, head_dim, log2_base, EMPTY_LSE_BOUND, EMPTY_LSE,
        WORLD=world, WORLD_P2=triton.next_power_of_2(world),
        BLOCK_ROWS=block_rows, BLOCK_D=block_d,
    )
    # BUG: the head blocks go out in reverse rank order, as over a DCP group ordered unlike TP.
    merged = (
        group.reduce_scatter(scaled.unflatten(0, (world, -1)).flip(0).flatten(0, 1), dim=0)
        .transpose(0, 1).to(out.dtype).contiguous()
    )
    heads_local = num_heads // world
    own = slice(rank * heads_local, (rank + 1) * heads_local)
    return merged, merged_lse[:, own].contiguous()


class ReduceScatterWrongRankOrder(CombineMutant):
    description = "ag_rs reduce-scatters the head blocks in reverse rank order: rank r keeps rank W-1-r's heads"
    bug = Swap(port_combine, _combine_ag_rs=_combine_ag_rs_reversed_ranks)


def _combine_ag_rs_all_heads_lse(out, lse, group, log2_base):
    num_tokens, num_heads, head_dim = out.shape
    world, rank = group.world_size, group.rank_in_group
    lses = group.all_gather(lse, dim=0).view(world, num_tokens, num_heads)
    scaled = torch.empty(num_heads, num_tokens, head_dim, dtype=torch.float32, device=out.device)
    merged_lse = torch.empty(lse.shape, dtype=torch.float32, device=out.device)
    grid, block_rows, block_d = _launch_shape(num_tokens * num_heads, head_dim)
    _rescale_local_kernel[grid](
        out, lse, lses, scaled, merged_lse,
        num_tokens, num_heads, head_dim, log2_base, EMPTY_LSE_BOUND, EMPTY_LSE,
        WORLD=world, WORLD_P2=triton.next_power_of_2(world),
        BLOCK_ROWS=block_rows, BLOCK_D=block_d,
    )
    merged = group.reduce_scatter(scaled, dim=0).transpose(0, 1).to(out.dtype).contiguous()
    heads_local = num_heads // world
    own = slice(rank * heads_local, (rank + 1) * heads_local)  # noqa: F841  (unused: the bug)
    return merged, merged_lse  # BUG: the merged LSE of all H heads, not this rank's


class ReturnLseAllHeads(CombineMutant):
    description = "ag_rs with return_lse returns the merged LSE of all H heads instead of this rank's H/W"
    bug = Swap(port_combine, _combine_ag_rs=_combine_ag_rs_all_heads_lse)


def _combine_a2a_strided_slices(out, lse, group, log2_base):
    num_tokens, num_heads, head_dim = out.shape
    world = group.world_size
    heads_local = num_heads // world
    lse_width = lse.element_size() // out.element_size()
    lse_columns = lse.view(out.dtype).view(num_tokens, num_heads, lse_width)
    packed = torch.cat([out, lse_columns], dim=2)
    row_width = packed.shape[2]
    # BUG: slice j is heads j, j+W, ..., not rank j's block.
    send = packed.view(num_tokens, heads_local, world, row_width).permute(2, 0, 1, 3).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group.device_group)
    lses = received[..., head_dim:].contiguous().view(torch.float32).view(world, num_tokens * heads_local)

    merged = torch.empty(num_tokens, heads_local, head_dim, dtype=out.dtype, device=out.device)
    merged_lse = torch.empty(num_tokens, heads_local, dtype=torch.float32, device=out.device)
    num_rows = num_tokens * heads_local
    grid, block_rows, block_d = _launch_shape(num_rows, head_dim)
    _sum_received_kernel[grid](
        received, lses, merged, merged_lse,
        num_rows, head_dim, row_width, log2_base, EMPTY_LSE_BOUND, EMPTY_LSE,
        WORLD=world, WORLD_P2=triton.next_power_of_2(world),
        BLOCK_ROWS=block_rows, BLOCK_D=block_d,
    )
    return merged, merged_lse


class A2aSliceToWrongRank(CombineMutant):
    description = "a2a sends rank j the strided heads j, j+W, ... instead of its block of H/W heads"
    bug = Swap(port_combine, _combine_a2a=_combine_a2a_strided_slices)


def _combine_w1_not_special(out, lse, group, *, backend="ag_rs", lse_base=2.0, return_lse=False):
    world = group.world_size
    _check_inputs(out, lse, world, backend, lse_base)
    # BUG: the W = 1 shortcut (return the inputs unchanged) is gone.
    out = out.contiguous()
    lse = lse.float().contiguous()
    combine_backend = _combine_ag_rs if backend == "ag_rs" else _combine_a2a
    merged, merged_lse = combine_backend(out, lse, group, math.log2(lse_base))
    return (merged, merged_lse) if return_lse else merged


class W1NotShortCircuited(CombineMutant):
    description = "combine at W = 1 runs its collectives and kernels instead of returning the inputs unchanged"
    bug = Swap(port_combine, combine=_combine_w1_not_special)


def _dcp_attention_sinks_on_rank0(
    q_local, sink_local, comp_cache, comp_slots, swa_cache, swa_slots, group, *,
    scale, backend="ag_rs", token_chunk=None,
):
    if token_chunk is not None and token_chunk < 1:
        raise ValueError(f"dcp_attention: token_chunk={token_chunk}; accepted: None or >= 1")
    # BUG: only rank 0 applies the sink, so only rank 0 joins the sink all-gather.
    sink = None if sink_local is None or group.rank_in_group != 0 else gather_heads(sink_local, group, dim=0)
    num_tokens = q_local.shape[0]
    if num_tokens == 0:
        return q_local.new_empty(q_local.shape)
    step = token_chunk or num_tokens
    outputs = []
    for start in range(0, num_tokens, step):
        rows = slice(start, start + step)
        q = gather_heads(q_local[rows], group, dim=1)
        out, lse = partial_attention(
            q,
            comp_cache,
            comp_slots[rows],
            swa_cache,
            None if swa_slots is None else swa_slots[rows],
            sink,
            scale=scale,
            rank=group.rank_in_group,
        )
        outputs.append(combine(out, lse, group, backend=backend))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)


class CollectiveSkippedOnOneRank(CombineMutant):
    description = "only rank 0 joins the sink all-gather (it alone applies the sinks): the ranks' collectives diverge"
    bug = Swap(port_attention, dcp_attention=_dcp_attention_sinks_on_rank0)
