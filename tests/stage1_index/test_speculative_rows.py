"""Speculative (MTP) verification rows, q_len = 1 + k for k = 1 to 4, written and
read through the DCP placement rank by rank: a proposer that bypasses the DCP slot
mapping (the GB10 bring-up's) writes every global token on every rank
(the check is :mod:`dcpcheck.checks.speculative`)."""

from __future__ import annotations

import pytest

from dcpcheck.checks.speculative import check_speculative_rows
from dcpcheck.stages import STAGE_INDEX

pytestmark = [pytest.mark.stage(STAGE_INDEX), pytest.mark.needs("filter_index", "slot_mapping")]
DSV41_RATIO2 = pytest.mark.scenario("dsv41_ratio2")


@pytest.mark.parametrize(
    "S, bs, rho, K",
    [
        pytest.param(1, 4, 1, 16, id="I1-S1-bs4-rho1-K16"),
        pytest.param(2, 8, 1, 33, id="I2-S2-bs8-rho1-K33"),
        pytest.param(2, 8, 2, 24, id="I4-S2-bs8-rho2-K24", marks=DSV41_RATIO2),
    ],
)
def test_speculative_rows_written_and_read_by_their_owner(dcp, S, bs, rho, K):
    dcp.run(check_speculative_rows, S=S, bs=bs, rho=rho, K=K)
