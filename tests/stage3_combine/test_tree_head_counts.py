"""The head counts the port serves under DCP: the kernel sees the ranks'
local heads gathered in TP order and the combine's reduce-scatter hands each
rank back its own slice, so a padded local count, or more gathered heads than
a kernel takes, must be refused when the layer is built. The implementation
asks its tree's layer ``__init__`` (``serving_probes``)."""

from __future__ import annotations

import pytest

from dcpcheck.checks.serving_probes import check_serving_probe
from dcpcheck.stages import STAGE_COMBINE

pytestmark = [pytest.mark.stage(STAGE_COMBINE), pytest.mark.needs("serving_probes"), pytest.mark.world_sizes(1)]


def test_port_refuses_the_head_counts_it_cannot_combine(dcp):
    dcp.run(check_serving_probe, name="DCP head counts")
