"""Stage 3 of the port, combine side: merge per-rank partials by their LSE.

``L = log_b(sum_r b^lse_r)``, ``o = sum_r b^(lse_r - L) out_r``, then every
rank keeps its own heads ``[r*H_loc, (r+1)*H_loc)``. Two backends:

* ``ag_rs``: all-gather the LSEs ``[W, T, H]``, a Triton kernel rescales the
  local partial by ``b^(lse_r - L)`` into a head-major fp32 buffer, then
  reduce-scatter over heads;
* ``a2a``: one all-to-all of the partial output with its LSE packed into the
  same buffer, per head slice, then a Triton kernel sums the W slices.

Empty partials (LSE -inf or at most ``EMPTY_LSE_BOUND``) get no weight, and a
NaN output under them is dropped. Both kernels upcast to fp32 right after each
load: the math runs in fp32 whatever the output dtype.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from .conventions import EMPTY_LSE, EMPTY_LSE_BOUND
from .triton_env import COMBINE_TILE_ELEMENTS

COMBINE_BACKENDS = ("ag_rs", "a2a")
OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _merge_scale(lses_ptr, rows, row_ok, num_rows, log2_base, empty_bound, WORLD: tl.constexpr, WORLD_P2: tl.constexpr):
    """Per row: the max LSE over ranks with mass (the shift), the sum of their
    weights b^(lse_r - shift) (1 where no rank has mass, a safe divisor), and
    whether any rank has mass."""
    ranks = tl.arange(0, WORLD_P2).to(tl.int64)
    mask = (ranks[:, None] < WORLD) & row_ok[None, :]
    lses = tl.load(lses_ptr + ranks[:, None] * num_rows + rows[None, :], mask=mask, other=float("-inf")).to(tl.float32)
    has_mass = lses > empty_bound
    row_max = tl.max(tl.where(has_mass, lses, float("-inf")), axis=0)
    any_mass = row_max > empty_bound
    shift = tl.where(any_mass, row_max, 0.0)
    weights = tl.where(has_mass, tl.exp2((lses - shift[None, :]) * log2_base), 0.0)
    return shift, tl.where(any_mass, tl.sum(weights, axis=0), 1.0), any_mass


@triton.jit
def _rank_weight(lse, shift, total, log2_base, empty_bound):
    """b^(lse_r - L) for one rank's LSE; 0 for an empty partial."""
    return tl.where(lse > empty_bound, tl.exp2((lse - shift) * log2_base) / total, 0.0)


@triton.jit
def _merged_lse(shift, total, any_mass, log2_base, empty_lse):
    return tl.where(any_mass, shift + tl.log2(total) / log2_base, empty_lse)


@triton.jit
def _rescale_local_kernel(
    out_ptr,
    own_lse_ptr,
    lses_ptr,
    scaled_ptr,
    merged_lse_ptr,
    num_tokens,
    num_heads,
    head_dim,
    log2_base,
    empty_bound,
    empty_lse,
    WORLD: tl.constexpr,
    WORLD_P2: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """ag_rs: scaled[h, t] = out_local[t, h] * b^(lse_local - L) in fp32 (head-major,
    so the reduce-scatter over heads needs no transpose), and L for every [t, h]."""
    num_rows = num_tokens * num_heads
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
    row_ok = rows < num_rows
    shift, total, any_mass = _merge_scale(lses_ptr, rows, row_ok, num_rows, log2_base, empty_bound, WORLD, WORLD_P2)
    tl.store(merged_lse_ptr + rows, _merged_lse(shift, total, any_mass, log2_base, empty_lse), mask=row_ok)

    own_lse = tl.load(own_lse_ptr + rows, mask=row_ok, other=float("-inf")).to(tl.float32)
    weight = _rank_weight(own_lse, shift, total, log2_base, empty_bound)
    cols = tl.arange(0, BLOCK_D).to(tl.int64)
    tile_ok = row_ok[:, None] & (cols[None, :] < head_dim)
    partial = tl.load(out_ptr + rows[:, None] * head_dim + cols[None, :], mask=tile_ok, other=0.0).to(tl.float32)
    scaled = tl.where(weight[:, None] > 0, partial * weight[:, None], 0.0)
    head_major_rows = (rows % num_heads) * num_tokens + rows // num_heads
    tl.store(scaled_ptr + head_major_rows[:, None] * head_dim + cols[None, :], scaled, mask=tile_ok)


@triton.jit
def _sum_received_kernel(
    parts_ptr,
    lses_ptr,
    merged_ptr,
    merged_lse_ptr,
    num_rows,
    head_dim,
    part_row_stride,
    log2_base,
    empty_bound,
    empty_lse,
    WORLD: tl.constexpr,
    WORLD_P2: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """a2a: merged = sum_r b^(lse_r - L) part_r over the W received slices, summed
    as one [W, rows, D] tile (a loop over ranks costs the interpreter W times
    the work)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
    row_ok = rows < num_rows
    shift, total, any_mass = _merge_scale(lses_ptr, rows, row_ok, num_rows, log2_base, empty_bound, WORLD, WORLD_P2)
    tl.store(merged_lse_ptr + rows, _merged_lse(shift, total, any_mass, log2_base, empty_lse), mask=row_ok)

    ranks = tl.arange(0, WORLD_P2).to(tl.int64)
    slice_ok = (ranks[:, None] < WORLD) & row_ok[None, :]
    received_rows = ranks[:, None] * num_rows + rows[None, :]  # [W, rows] into the W * num_rows received rows
    lses = tl.load(lses_ptr + received_rows, mask=slice_ok, other=float("-inf")).to(tl.float32)
    weights = _rank_weight(lses, shift[None, :], total[None, :], log2_base, empty_bound)
    cols = tl.arange(0, BLOCK_D).to(tl.int64)
    tile_ok = slice_ok[:, :, None] & (cols[None, None, :] < head_dim)
    part_offsets = received_rows[:, :, None] * part_row_stride + cols[None, None, :]
    parts = tl.load(parts_ptr + part_offsets, mask=tile_ok, other=0.0).to(tl.float32)
    weighted = tl.where(weights[:, :, None] > 0, parts * weights[:, :, None], 0.0)
    merged = tl.sum(weighted, axis=0)
    out_ok = row_ok[:, None] & (cols[None, :] < head_dim)
    tl.store(merged_ptr + rows[:, None] * head_dim + cols[None, :], merged.to(merged_ptr.dtype.element_ty), mask=out_ok)


def _launch_shape(num_rows: int, head_dim: int, slices: int = 1) -> tuple[tuple[int], int, int]:
    """-> (grid, BLOCK_ROWS, BLOCK_D) for a kernel over [num_rows, head_dim] whose
    widest tile is [slices, BLOCK_ROWS, BLOCK_D]."""
    block_d = triton.next_power_of_2(head_dim)
    block_rows = max(1, min(COMBINE_TILE_ELEMENTS // (slices * block_d), triton.next_power_of_2(num_rows)))
    return (triton.cdiv(num_rows, block_rows),), block_rows, block_d


def _check_inputs(out: torch.Tensor, lse: torch.Tensor, world: int, backend: str, lse_base: float) -> None:
    if backend not in COMBINE_BACKENDS:
        raise ValueError(f"combine: unknown backend {backend!r}; accepted: {COMBINE_BACKENDS}")
    if not (lse_base > 0 and lse_base != 1):
        raise ValueError(
            f"combine: lse_base={lse_base!r}; accepted: a positive base other "
            f"than 1 (2.0 for the port's kernels, math.e for base-e kernels)"
        )
    if out.dtype not in OUTPUT_DTYPES:
        raise ValueError(
            f"combine: partial output dtype {out.dtype} is not supported; "
            f"accepted: float32, float16, bfloat16 (with an fp32 LSE)"
        )
    if out.dim() != 3 or tuple(lse.shape) != tuple(out.shape[:2]):
        raise ValueError(
            f"combine: expected out [T, H, D] and lse [T, H], got out {tuple(out.shape)} and lse {tuple(lse.shape)}"
        )
    num_heads = out.shape[1]
    if num_heads % world:
        raise ValueError(
            f"combine: H={num_heads} heads cannot be split over W={world} DCP ranks; "
            f"accepted: H a multiple of W (here H in {{{world}, {2 * world}, {3 * world}, ...}})"
        )


def _combine_ag_rs(out, lse, group, log2_base):
    num_tokens, num_heads, head_dim = out.shape
    world, rank = group.world_size, group.rank_in_group
    lses = group.all_gather(lse, dim=0).view(world, num_tokens, num_heads)  # rank-major
    scaled = torch.empty(num_heads, num_tokens, head_dim, dtype=torch.float32, device=out.device)
    merged_lse = torch.empty(lse.shape, dtype=torch.float32, device=out.device)
    grid, block_rows, block_d = _launch_shape(num_tokens * num_heads, head_dim)
    _rescale_local_kernel[grid](
        out,
        lse,
        lses,
        scaled,
        merged_lse,
        num_tokens,
        num_heads,
        head_dim,
        log2_base,
        EMPTY_LSE_BOUND,
        EMPTY_LSE,
        WORLD=world,
        WORLD_P2=triton.next_power_of_2(world),
        BLOCK_ROWS=block_rows,
        BLOCK_D=block_d,
    )
    # fp32 on the wire so the sum rounds once to out.dtype, as the a2a kernel does.
    merged = group.reduce_scatter(scaled, dim=0).transpose(0, 1).to(out.dtype).contiguous()
    heads_local = num_heads // world
    own = slice(rank * heads_local, (rank + 1) * heads_local)
    return merged, merged_lse[:, own].contiguous()


def _combine_a2a(out, lse, group, log2_base):
    num_tokens, num_heads, head_dim = out.shape
    world = group.world_size
    heads_local = num_heads // world
    # The fp32 LSE rides bit-for-bit as 1 (fp32) or 2 (16-bit) extra columns.
    lse_width = lse.element_size() // out.element_size()
    lse_columns = lse.view(out.dtype).view(num_tokens, num_heads, lse_width)
    row_width = head_dim + lse_width
    # Written straight into the send layout, one copy each ([r]: the heads of rank r).
    send = torch.empty(world, num_tokens, heads_local, row_width, dtype=out.dtype, device=out.device)
    send[..., :head_dim] = out.view(num_tokens, world, heads_local, head_dim).transpose(0, 1)
    send[..., head_dim:] = lse_columns.view(num_tokens, world, heads_local, lse_width).transpose(0, 1)
    received = torch.empty_like(send)  # [W, T, H_loc, D + c]: [r] is rank r's partial of my heads
    # The GroupCoordinator surface has no all-to-all: torch.distributed on its device group.
    dist.all_to_all_single(received, send, group=group.device_group)
    lses = received[..., head_dim:].contiguous().view(torch.float32).view(world, num_tokens * heads_local)

    merged = torch.empty(num_tokens, heads_local, head_dim, dtype=out.dtype, device=out.device)
    merged_lse = torch.empty(num_tokens, heads_local, dtype=torch.float32, device=out.device)
    num_rows = num_tokens * heads_local
    world_p2 = triton.next_power_of_2(world)
    grid, block_rows, block_d = _launch_shape(num_rows, head_dim, slices=world_p2)
    _sum_received_kernel[grid](
        received,
        lses,
        merged,
        merged_lse,
        num_rows,
        head_dim,
        row_width,
        log2_base,
        EMPTY_LSE_BOUND,
        EMPTY_LSE,
        WORLD=world,
        WORLD_P2=world_p2,
        BLOCK_ROWS=block_rows,
        BLOCK_D=block_d,
    )
    return merged, merged_lse


def combine(
    out: torch.Tensor,
    lse: torch.Tensor,
    group,
    *,
    backend: str = "ag_rs",
    lse_base: float = 2.0,
    return_lse: bool = False,
):
    """LSE-weighted merge of the ranks' partials, then keep this rank's heads.

    out [T, H, D] (fp32/fp16/bf16), lse [T, H] fp32 in ``lse_base``.
    -> out [T, H_loc, D] in out.dtype, or (out, lse [T, H_loc] fp32 in
    ``lse_base``) when ``return_lse``. W = 1 returns the inputs unchanged.
    """
    world = group.world_size
    _check_inputs(out, lse, world, backend, lse_base)
    if world == 1:
        return (out, lse) if return_lse else out
    out = out.contiguous()
    lse = lse.float().contiguous()
    combine_backend = _combine_ag_rs if backend == "ag_rs" else _combine_a2a
    merged, merged_lse = combine_backend(out, lse, group, math.log2(lse_base))
    return (merged, merged_lse) if return_lse else merged
