"""Stage 1 on W ranks: the ranks' filtered top-k partitions the DCP1 set, and
what a rank reads is where it (and only it) writes (the checks are in
:mod:`dcpcheck.checks.partition`).
"""

from __future__ import annotations

import pytest

from dcpcheck.checks.partition import check_partition
from dcpcheck.stages import STAGE_INDEX

pytestmark = [pytest.mark.stage(STAGE_INDEX), pytest.mark.needs("filter_index", "slot_mapping")]
SHORT_TABLE = pytest.mark.scenario("short_table")  # table_slack < 0
V40 = pytest.mark.scenario("v40_ratios")
DSV41_RATIO2 = pytest.mark.scenario("dsv41_ratio2")


# (S, bs, K, rho, table_slack, num_decodes): every S with two page sizes, K
# never a multiple of 16, short tables (slack < 0) in half the cases, and
# batches of 72 tokens (num_decodes=50: more than one 64-token block) in three.
# DeepSeek-V4.0's ratios (4, 128): the generic filter and writer.
V40_CASES = [
    pytest.param(1, 1, 37, 4, 2, 4, id="S1-bs1-K37-rho4", marks=V40),
    pytest.param(1, 16, 100, 128, -1, 50, id="S1-bs16-K100-rho128-short_table-T72", marks=[SHORT_TABLE, V40]),
    pytest.param(2, 2, 61, 128, 0, 4, id="S2-bs2-K61-rho128", marks=V40),
    pytest.param(2, 6, 131, 4, -1, 4, id="S2-bs6-K131-rho4-short_table", marks=[SHORT_TABLE, V40]),
    pytest.param(16, 16, 45, 4, 2, 50, id="S16-bs16-K45-rho4-T72", marks=V40),
    pytest.param(16, 64, 300, 4, -2, 4, id="S16-bs64-K300-rho4-short_table", marks=[SHORT_TABLE, V40]),
    pytest.param(64, 64, 1, 4, 2, 4, id="S64-bs64-K1-rho4", marks=V40),
    pytest.param(64, 128, 200, 128, -1, 50, id="S64-bs128-K200-rho128-short_table-T72", marks=[SHORT_TABLE, V40]),
]
# DeepSeek-V4.1's ratios on vLLM's 128-token compressed page (64 states at
# ratio 2), at a --cp-kv-cache-interleave-size of I tokens (S = I / rho
# states): one state, half a page and a whole page a rank in turn; top-k
# rows of several of the embedded port's 128-wide top-k tiles (vLLM's filter
# runs each row as one tile: below).
DSV41_CASES = [
    pytest.param(1, 64, 300, 2, 2, 4, id="I2-S1-bs64-K300-rho2", marks=DSV41_RATIO2),
    pytest.param(32, 64, 131, 2, 0, 50, id="I64-S32-bs64-K131-rho2-T72", marks=DSV41_RATIO2),
    pytest.param(64, 64, 45, 2, 1, 4, id="I128-S64-bs64-K45-rho2", marks=DSV41_RATIO2),
    pytest.param(2, 128, 37, 1, 1, 50, id="I2-S2-bs128-K37-rho1-T72"),
    # vllm#56715 (interleave 64 under DCP4: token 1 read the key of token 64), at ratio 1, where an interleave
    # of 64 or 128 tokens is half a page and a whole page of states a rank in turn.
    pytest.param(64, 128, 200, 1, 0, 4, id="I64-S64-bs128-K200-rho1"),
    pytest.param(128, 128, 131, 1, 1, 4, id="I128-S128-bs128-K131-rho1"),
]
# The top-k widths vLLM serves DSV4.1 at under DCP (its DCP top-k merge takes
# index_topk 512, 1024 or 2048: model_executor/layers/sparse_attn_indexer.py,
# _assert_cutedsl_dcp_merge_supported): rows of 4, 8 and 16 of the embedded
# port's 128-wide top-k tiles (its loop over them: mutant TopkTilesCapped).
# vLLM's filter, triton_filter_and_convert_dcp_index, counts and compacts, so
# its _remap_tiling (v1/attention/backends/mla/sparse_utils.py) gives one
# program the whole row up to 4096: these widths run its single-tile branch,
# here and in production.
SERVED_TOPK_CASES = [
    pytest.param(2, 128, 512, 1, 0, 4, id="I2-S2-bs128-K512-rho1"),
    pytest.param(1, 64, 1024, 2, 1, 4, id="I2-S1-bs64-K1024-rho2", marks=DSV41_RATIO2),
    pytest.param(64, 64, 2048, 2, 0, 4, id="I128-S64-bs64-K2048-rho2", marks=DSV41_RATIO2),
]
CASES = V40_CASES + DSV41_CASES + SERVED_TOPK_CASES


@pytest.mark.parametrize("S, bs, K, rho, table_slack, num_decodes", CASES)
def test_partition(dcp, S, bs, K, rho, table_slack, num_decodes):
    dcp.run(check_partition, S=S, bs=bs, K=K, rho=rho, table_slack=table_slack, num_decodes=num_decodes)


# Cases without cut pages (their write side is a known vLLM defect), one with
# a batch past one kernel block, at each model's ratios.
VIEW_CASES = [V40_CASES[0], V40_CASES[4], DSV41_CASES[0]]


@pytest.mark.parametrize("S, bs, K, rho, table_slack, num_decodes", VIEW_CASES)
def test_partition_given_views(dcp, S, bs, K, rho, table_slack, num_decodes):
    """Top-k and block tables as engines hand them over: column slices of
    wider buffers (row stride above the width)."""
    dcp.run(check_partition, S=S, bs=bs, K=K, rho=rho, table_slack=table_slack, num_decodes=num_decodes, views=True)
