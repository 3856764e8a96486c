"""No bug hides behind a finding of the DCP2 port: a tree whose vLLM DCP
writer (``v1/attention/backends/mla/compressor_utils.py``, a file of the
porter's stack other than the port's) writes ratio-2 states one state late
under DCP fails the ratio-2 e2e case that finding 1 (the read side's
interleave unit) makes an expected failure. The finding's cure (the read
side in states) runs the case again, and the writer's bug fails it; without
the cure the case stayed xfailed, the second bug unseen.

Needs vLLM on CPU (``tools/install_vllm_cpu.sh``); ``.ci/run`` runs this file
after installing it."""

from __future__ import annotations

from tests.selftest.support.scratch_trees import NEEDS_VLLM_AND_SEED, replace_in_tree, run_dsv41, seed_tree

WRITER = "vllm/v1/attention/backends/mla/compressor_utils.py"
STATE_LINE = "            pos_after_compress = local_pos // COMPRESS_RATIO\n"
# One state late at W > 1 for ratio 2 only: every other case writes as vLLM does.
STATE_LINE_LATE = (
    "            pos_after_compress = local_pos // COMPRESS_RATIO + (dcp_world_size - 1) * (COMPRESS_RATIO // 2)\n"
)
RATIO2_CASE = "tests/e2e/test_serving_trace.py::test_layer_order_within_a_step[W2-interleaved_kv_groups]"

pytestmark = NEEDS_VLLM_AND_SEED


def test_a_writer_bug_behind_finding_1_fails_its_case(tmp_path):
    tree = seed_tree(tmp_path / "tree")
    replace_in_tree(tree, WRITER, STATE_LINE, STATE_LINE_LATE)
    done = run_dsv41(tree, RATIO2_CASE, world_size=2)
    output = done.stdout + done.stderr
    assert done.returncode == 1 and "1 failed" in output, output[-5000:]
    assert "a second bug behind the known defect: with dsv41's cures read_unit_in_states" in output, output[-5000:]
    assert "DCP-W vs float64 oracle" in output.split("the case still fails:")[1], output[-5000:]
