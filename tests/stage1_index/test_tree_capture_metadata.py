"""The metadata a CUDA graph captures against the real step's, rank by rank: the
tree's DSV4.1 metadata builder through ``build_for_cudagraph_capture`` and through
``build``, from the same rank-local inputs (the GB10 bring-up's graph-capture builder
omitted the DCP-local lengths). The implementation asks its tree (``serving_probes``)."""

from __future__ import annotations

import pytest

from dcpcheck.checks.serving_probes import check_serving_probe
from dcpcheck.stages import STAGE_INDEX

pytestmark = [pytest.mark.stage(STAGE_INDEX), pytest.mark.needs("serving_probes"), pytest.mark.world_sizes(1)]


def test_captured_metadata_is_the_real_steps(dcp):
    dcp.run(check_serving_probe, name="graph-capture metadata")
