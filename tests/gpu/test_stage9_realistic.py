"""Stage 9 at the realistic profiles (CUDA; DeepSeek-V4.0's compress ratios 4
and 128, V4.1's 1 and 2): a prefill step whose long request
prefills several thousand tokens, through the implementation's attention
layer on both prefill paths (the compressed-KV gather, and stage 3 in
sub-chunks), against DCP1: the implementation's own W = 1 layer on every
row, and the float64 oracle on spot rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

from dcpcheck.checks.prefill import PrefillStep, port_dcp1, run_layer
from dcpcheck.checks.same_inputs import check_same_inputs
from dcpcheck.compare import assert_close
from dcpcheck.oracle.prefill import dense_state_slots
from dcpcheck.scenarios.attention import build_attention_inputs, comp_cache_for
from dcpcheck.scenarios.batch import rank_block_table
from dcpcheck.scenarios.profiles import PROFILES
from dcpcheck.stages import STAGE_PREFILL
from tests.gpu.common import oracle_spot_check, profile_name, shared_seed, spot_rows, summary

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.stage(STAGE_PREFILL),
    pytest.mark.needs("build_attention", "prefill_geometry", "prefill_gather", "prefill_remap"),
    # Measured on one H200 since the port attends 1024 rows at a time: at most 41.6 GiB reserved
    # by the 8 ranks of one case (W=8, rho=128, gather), 6.0 GiB by the one rank at W=1.
    pytest.mark.gpu_memory(6),
]

ORACLE_STRIDE = 64  # every 64th row (plus every request's first and last) against float64


@dataclass(frozen=True)
class PrefillScenario:
    step: PrefillStep  # this rank's view, caches on the device
    spot_rows: torch.Tensor
    oracle_out: torch.Tensor  # [len(spot_rows), H_loc, D] float64


@functools.lru_cache(maxsize=1)  # the paths of one rho share it: built once per rank process
def prefill_scenario(
    profile: str, rho: int, world_size: int, rank: int, seed: int, device: torch.device
) -> PrefillScenario:
    shapes = PROFILES[profile]
    batch = shapes.prefill_batch(rho, world_size, seed)
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
    table = rank_block_table(batch, rank)
    cache = comp_cache_for(batch, inputs, table, rank=rank, world_size=world_size)
    context = {"stage": STAGE_PREFILL, "W": world_size, "rank": rank, "profile": profile, "rho": rho,
               "T": batch.num_tokens, "scenario_seed": seed}  # fmt: skip
    step = PrefillStep(batch, inputs, heads, table.to(device), cache, context)
    rows = spot_rows(batch, ORACLE_STRIDE)
    dense_slots = dense_state_slots(batch.topk, batch.token_to_req, batch.is_valid_token, inputs.state_offsets)
    oracle_out, _ = oracle_spot_check(
        inputs.q[:, heads],
        inputs.states,
        dense_slots,
        inputs.swa_cache,
        inputs.swa_slots,
        inputs.sink[heads],
        scale=inputs.scale,
        rows=rows,
    )
    return PrefillScenario(step, rows, oracle_out)


def check_realistic_prefill(ctx, *, profile, rho, gather, backend, scenario_seed):
    scenario = prefill_scenario(profile, rho, ctx.world_size, ctx.rank, scenario_seed, ctx.device)
    step, batch = scenario.step, scenario.step.batch
    check_same_inputs(ctx, step.inputs)
    path = "gathered prefill" if gather else f"prefill in sub-chunks ({backend})"
    context = {**step.context, "path": path}
    options = {"prefill_gather": gather} if gather else {"prefill_gather": False, "backend": backend}
    out = run_layer(ctx.impl.build_attention(batch.layout, ctx.group, **options), step, ctx.device, on_device=True)
    dcp1 = port_dcp1(ctx, step, on_device=True)

    rows = scenario.spot_rows.tolist()
    labels = step.row_labels
    head_offsets = (0, step.heads.start, 0)  # messages name global heads
    stats = {
        "vs the implementation's W=1 path": assert_close(
            out, dcp1, what=f"realistic {path} vs the implementation's W=1 path",
            context=context, row_labels=labels, offsets=head_offsets,
        ),
        "vs float64 DCP1 oracle (spot rows)": assert_close(
            out[scenario.spot_rows], scenario.oracle_out, what=f"realistic {path} vs float64 DCP1 oracle (spot rows)",
            context=context, row_labels=[f"batch row {t}: {labels[t]}" for t in rows], offsets=head_offsets,
        ),
    }  # fmt: skip
    return summary(stats)


@pytest.mark.parametrize(
    "model, rho, gather, backend",
    [
        ("v4.0", 4, True, None), ("v4.0", 4, False, "ag_rs"), ("v4.0", 4, False, "a2a"),
        ("v4.0", 128, True, None), ("v4.0", 128, False, "a2a"),
        ("v4.1", 1, True, None), ("v4.1", 1, False, "a2a"),
        ("v4.1", 2, True, None), ("v4.1", 2, False, "ag_rs"), ("v4.1", 2, False, "a2a"),
    ],
)  # fmt: skip
def test_realistic_prefill_matches_dcp1(dcp, model, rho, gather, backend):
    dcp.run(
        check_realistic_prefill, profile=profile_name(dcp, model), rho=rho, gather=gather, backend=backend,
        scenario_seed=shared_seed(dcp, f"prefill-rho{rho}"),
    )  # fmt: skip
