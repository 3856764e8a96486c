"""Stage 3 at the realistic profiles (CUDA; DeepSeek-V4.0's compress ratios 4
and 128, V4.1's 1 and 2): a decode step of up to 256 rows
through the implementation's stage-1 filter and whole stage-3 path
(gather, partial attention over top-k 512 + window 128 + sink, combine) at
64 heads of D = 512 in bf16, against DCP1: the implementation's own W = 1
path on every row, and the float64 oracle on spot rows (every edge case).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

from dcpcheck.checks.same_inputs import check_same_inputs
from dcpcheck.checks.stage1 import filter_on_rank, stage1_slots
from dcpcheck.compare import assert_close
from dcpcheck.group import DcpGroup
from dcpcheck.scenarios.attention import AttentionInputs, build_attention_inputs, comp_cache_for
from dcpcheck.scenarios.batch import StepBatch, dcp1_block_table, rank_block_table
from dcpcheck.scenarios.profiles import PROFILES
from dcpcheck.stages import STAGE_COMBINE
from tests.gpu.common import oracle_spot_check, profile_name, shared_seed, spot_rows, summary

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.stage(STAGE_COMBINE),
    pytest.mark.needs("filter_index", "dcp_attention"),
    # Measured on one H200: up to 13.4 GiB for the 8 ranks of one case (W=8, rho=4), so under 2 GiB a rank.
    pytest.mark.gpu_memory(2),
]

ORACLE_STRIDE = 8  # every 8th row (plus every edge-case row) against float64


@dataclass(frozen=True)
class DecodeScenario:
    """One rank's view of a realistic decode step, and its float64 reference."""

    batch: StepBatch
    inputs: AttentionInputs
    heads: slice  # this rank's heads
    table: torch.Tensor  # this rank's block table
    comp_cache: torch.Tensor  # this rank's compressed cache, on the device
    swa_slots: torch.Tensor  # on the device
    dcp1_table: torch.Tensor
    dcp1_cache: torch.Tensor  # every state on one rank, on the device
    spot_rows: torch.Tensor
    oracle_out: torch.Tensor  # [len(spot_rows), H_loc, D] float64


@functools.lru_cache(maxsize=1)  # the backends of one rho share it: built once per rank process
def decode_scenario(
    profile: str, rho: int, world_size: int, rank: int, seed: int, device: torch.device
) -> DecodeScenario:
    shapes = PROFILES[profile]
    batch = shapes.decode_batch(rho, world_size, seed)
    inputs = build_attention_inputs(
        batch,
        num_heads=shapes.num_heads,
        head_dim=shapes.head_dim,
        window=shapes.window,
        dtype=shapes.dtype,
        seed=seed + 1,
        device=device,
    )
    heads_local = shapes.num_heads // world_size
    heads = slice(rank * heads_local, (rank + 1) * heads_local)
    table, dcp1_table = rank_block_table(batch, rank), dcp1_block_table(batch)
    dcp1_cache = comp_cache_for(batch, inputs, dcp1_table, rank=0, world_size=1)
    rows = spot_rows(batch, ORACLE_STRIDE)
    oracle_out, _ = oracle_spot_check(
        inputs.q[:, heads],
        dcp1_cache,
        stage1_slots(batch, dcp1_table, world_size=1, rank=0),
        inputs.swa_cache,
        inputs.swa_slots,
        inputs.sink[heads],
        scale=inputs.scale,
        rows=rows,
    )
    return DecodeScenario(
        batch, inputs, heads, table, comp_cache_for(batch, inputs, table, rank=rank, world_size=world_size),
        inputs.swa_slots.to(device), dcp1_table, dcp1_cache, rows, oracle_out,
    )  # fmt: skip


def check_realistic_decode(ctx, *, profile, rho, backend, scenario_seed):
    W, rank, device, impl = ctx.world_size, ctx.rank, ctx.device, ctx.impl
    scenario = decode_scenario(profile, rho, W, rank, scenario_seed, device)
    batch, inputs, heads = scenario.batch, scenario.inputs, scenario.heads
    check_same_inputs(ctx, inputs)
    context = {"stage": STAGE_COMBINE, "W": W, "rank": rank, "profile": profile, "rho": rho,
               "backend": backend, "T": batch.num_tokens, "scenario_seed": scenario_seed}  # fmt: skip

    slots, _ = filter_on_rank(impl, batch, scenario.table, device, world_size=W, rank=rank)
    out = impl.dcp_attention(
        inputs.q[:, heads],
        inputs.sink[heads],
        scenario.comp_cache,
        slots.to(device),
        inputs.swa_cache,
        scenario.swa_slots,
        ctx.group,
        scale=inputs.scale,
        backend=backend,
    )
    dcp1_slots, _ = filter_on_rank(impl, batch, scenario.dcp1_table, device, world_size=1, rank=0)
    dcp1 = impl.dcp_attention(  # this rank's heads: attention is per head
        inputs.q[:, heads],
        inputs.sink[heads],
        scenario.dcp1_cache,
        dcp1_slots.to(device),
        inputs.swa_cache,
        scenario.swa_slots,
        DcpGroup.single_rank(device),
        scale=inputs.scale,
    )

    rows = scenario.spot_rows.tolist()
    head_offsets = (0, heads.start, 0)  # messages name global heads
    stats = {
        "vs the implementation's W=1 path": assert_close(
            out, dcp1, what="realistic decode vs the implementation's W=1 path",
            context=context, row_labels=batch.row_labels, offsets=head_offsets,
        ),
        "vs float64 DCP1 oracle (spot rows)": assert_close(
            out[scenario.spot_rows], scenario.oracle_out, what="realistic decode vs float64 DCP1 oracle (spot rows)",
            context=context, row_labels=[f"batch row {t}: {batch.row_labels[t]}" for t in rows], offsets=head_offsets,
        ),
    }  # fmt: skip
    return summary(stats)


@pytest.mark.parametrize(
    "model, rho",
    [("v4.0", 4), ("v4.0", 128), ("v4.1", 1), ("v4.1", 2)],  # each model at its compress ratios
)
@pytest.mark.parametrize("backend", ["ag_rs", "a2a"])
def test_realistic_decode_matches_dcp1(dcp, model, rho, backend):
    dcp.run(
        check_realistic_decode, profile=profile_name(dcp, model), rho=rho, backend=backend,
        scenario_seed=shared_seed(dcp, f"decode-rho{rho}"),
    )  # fmt: skip
