"""Ranks launched with different ``DSV41_DCP_COMBINE`` / ``DSV41_DCP_PREFILL_GATHER``
(vllm #48248's review: a backend decided per rank, without agreement): the port
must refuse, or its ranks must issue the same collectives. Asked in one process
of rank 0's and rank 1's layers, each built under its own setting, their
collectives recorded, never entered (``serving_probes``)."""

from __future__ import annotations

import pytest

from dcpcheck.checks.serving_probes import check_serving_probe
from dcpcheck.stages import STAGE_COMBINE

pytestmark = [pytest.mark.stage(STAGE_COMBINE), pytest.mark.needs("serving_probes"), pytest.mark.world_sizes(1)]


@pytest.mark.scenario("tree_backend_agreement")
def test_ranks_with_different_backends_agree_or_refuse(dcp):
    dcp.run(check_serving_probe, name="per-rank backend agreement")
