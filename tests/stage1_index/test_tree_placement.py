"""Where the tree's own code writes compressed states under DCP, and where the
port's read side looks for them: both against vLLM's DCP writer
(``get_compressed_slot_mapping`` with ``dcp_world_size`` and ``cp_interleave``,
as vLLM's indexer calls it), at W = 2, compress ratio 2 and a 2-token
interleave. The implementation asks its tree (``serving_probes``); the e2e
traces then show what each answer does to the layer's output. Last, where the
tree's indexer refuses DCP (the interleaves the e2e sweep skips): its metadata
builder against dcpcheck's model of that rule."""

from __future__ import annotations

import pytest

from dcpcheck.checks.serving_probes import check_serving_probe
from dcpcheck.stages import STAGE_INDEX

pytestmark = [pytest.mark.stage(STAGE_INDEX), pytest.mark.needs("serving_probes"), pytest.mark.world_sizes(1)]


@pytest.mark.scenario("tree_compressed_writer")
def test_tree_writes_compressed_states_where_vllms_dcp_writer_does(dcp):
    dcp.run(check_serving_probe, name="compressed writer")


@pytest.mark.scenario("tree_read_unit")
def test_port_reads_compressed_states_where_vllms_dcp_writer_puts_them(dcp):
    dcp.run(check_serving_probe, name="read side's interleave unit")


def test_tree_refuses_dcp_where_dcpchecks_model_does(dcp):
    dcp.run(check_serving_probe, name="indexer's DCP refusal")
