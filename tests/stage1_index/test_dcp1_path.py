"""Stage 1 at W = 1: the implementation's DCP1 path equals the oracle, around
every power-of-two tile edge of K, over batches of several kernel blocks of
tokens, with no valid token and with no token at all."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dcpcheck.checks.stage1 import dcp1_producer_batch, filter_on_rank, slot_mapping_on_rank
from dcpcheck.compare import TokenRows, assert_compact_prefix, assert_equal_ints, assert_row_sets_equal
from dcpcheck.oracle.layout import filter_index_reference, write_slot_mapping
from dcpcheck.scenarios.batch import KvLayout, StepBatch, build_step_batch, rank_block_table, select_rows
from dcpcheck.stages import STAGE_INDEX

pytestmark = [
    pytest.mark.stage(STAGE_INDEX),
    pytest.mark.needs("filter_index", "slot_mapping"),
    pytest.mark.world_sizes(1),
]
SHORT_TABLE = pytest.mark.scenario("short_table")  # table_slack < 0
V40 = pytest.mark.scenario("v40_ratios")  # DeepSeek-V4.0's ratios: the generic filter and writer

# One below, at and one above the tile sizes a kernel is likely to use.
TOP_K_AROUND_TILES = (1, 15, 16, 17, 31, 33, 63, 64, 65, 127, 129)


def check_dcp1_path(ctx, *, S, bs, rho, table_slack):
    layout = KvLayout(rho=rho, bs=bs, interleave=S, world_size=1)
    for K in TOP_K_AROUND_TILES:
        seed = ctx.seed + K
        batch = build_step_batch(layout, top_k=K, seed=seed, num_decodes=60, table_slack=table_slack)
        table = rank_block_table(batch, 0)
        case = f"stage 1 case W=1 S={S} bs={bs} K={K} rho={rho} table_slack={table_slack} seed={seed}"
        check_w1_filter(ctx, batch, table, f"{case} (as built)")
        no_valid_token = replace(batch, is_valid_token=torch.zeros_like(batch.is_valid_token))
        check_w1_filter(ctx, no_valid_token, table, f"{case} (no valid token)")
        check_w1_filter(ctx, select_rows(batch, slice(0, 0)), table, f"{case} (no token)")

    batch = build_step_batch(layout, top_k=1, seed=ctx.seed, table_slack=table_slack)
    case = f"stage 1 case W=1 S={S} bs={bs} rho={rho} table_slack={table_slack} seed={ctx.seed}"
    check_w1_slot_mapping(ctx, batch, rank_block_table(batch, 0), case)


def check_w1_filter(ctx, batch: StepBatch, table, case: str) -> None:
    layout = batch.layout
    rows = TokenRows(case, batch.token_to_req, batch.row_labels)
    slots, counts = filter_on_rank(ctx.impl, dcp1_producer_batch(batch, table), table, ctx.device, world_size=1, rank=0)
    owned, expected_slots = filter_index_reference(
        batch.topk, batch.token_to_req, table, batch.is_valid_token, bs=layout.bs, S=layout.interleave, W=1, r=0
    )
    assert_compact_prefix(slots, counts, rows, what="W=1 slots")
    assert_row_sets_equal(slots, expected_slots, rows, what="slots of the W=1 path vs the oracle DCP1")
    assert_equal_ints(counts, owned.sum(1), case=case, what="W=1 counts vs the oracle DCP1", name_index=rows.name)


def check_w1_slot_mapping(ctx, batch: StepBatch, table, case: str) -> None:
    """Every position up to the longest request's length, spread over all requests."""
    layout = batch.layout
    positions = torch.arange(int(batch.seq_lens.max()))
    reqs = positions % batch.num_requests
    written = slot_mapping_on_rank(ctx.impl, layout, positions, reqs, table, ctx.device, rank=0)
    expected = write_slot_mapping(positions, reqs, table, rho=layout.rho, bs=layout.bs, S=layout.interleave, W=1, r=0)
    assert_equal_ints(
        written,
        expected,
        case=case,
        what="W=1 slot_mapping vs the oracle",
        name_index=lambda i: f"request {int(reqs[i])} position {int(positions[i])}",
    )


@pytest.mark.parametrize(
    "S, bs, rho, table_slack",
    [
        pytest.param(1, 4, 4, 1, id="S1-bs4-rho4", marks=V40),
        pytest.param(2, 10, 128, -1, id="S2-bs10-rho128-short_table", marks=[SHORT_TABLE, V40]),
        pytest.param(64, 64, 4, 0, id="S64-bs64-rho4", marks=V40),
        # DeepSeek-V4.1's ratios on vLLM's 128-token compressed page.
        pytest.param(1, 64, 2, 1, id="I2-S1-bs64-rho2"),
        pytest.param(2, 128, 1, 0, id="I2-S2-bs128-rho1"),
    ],
)
def test_dcp1_path(dcp, S, bs, rho, table_slack):
    dcp.run(check_dcp1_path, S=S, bs=bs, rho=rho, table_slack=table_slack)
