"""The port's call of its attention kernel (FlashInfer's SM120 sparse MLA,
which the reference kernel stands in for here) against the signature of the
FlashInfer installed beside the tree. The implementation reads both sources
(``serving_probes``)."""

from __future__ import annotations

import pytest

from dcpcheck.checks.serving_probes import check_serving_probe
from dcpcheck.stages import STAGE_COMBINE

pytestmark = [pytest.mark.stage(STAGE_COMBINE), pytest.mark.needs("serving_probes"), pytest.mark.world_sizes(1)]


@pytest.mark.scenario("tree_kernel_call")
def test_port_calls_the_kernel_with_its_signature(dcp):
    dcp.run(check_serving_probe, name="FlashInfer kernel call")
