"""The served model's shapes against the SM120 kernel's envelope, at start-up: heads per rank at
each TP x DCP on 2 and 4 GPUs, the served top-k widths, MTP decode rows and the prefill route,
against the envelope of the FlashInfer release vLLM pins and vLLM's own init check. The
implementation asks it (``serving_probes``: :mod:`dcpcheck.impls.dsv41.probes.kernel_envelope`)."""

from __future__ import annotations

import pytest

from dcpcheck.checks.serving_probes import check_serving_probe
from dcpcheck.stages import STAGE_COMBINE

pytestmark = [pytest.mark.stage(STAGE_COMBINE), pytest.mark.needs("serving_probes"), pytest.mark.world_sizes(1)]


@pytest.mark.scenario("tree_kernel_envelope")
def test_the_kernel_has_every_served_shape(dcp):
    dcp.run(check_serving_probe, name="SM120 kernel envelope")
