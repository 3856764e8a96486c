"""``--dcp-impl dsv41``'s stand-ins give way to the tree's own pieces
(:mod:`dcpcheck.impls.dsv41.findings.stand_ins`): a scratch tree whose
``DeepseekV4Attention.__init__`` sets the layer's DCP attributes itself, its
interleave in compressed states (a stack that hands the port states), is run
with them, not dcpcheck's: its manifest line says the tree's, and finding 1's
probe, which the suite's token-unit stand-in decides, finds nothing. The seed
tree on plain vLLM 0.33.0 gets the stand-in and the finding. In both, the
DCP group's line says the tree's ``GroupCoordinator`` runs.

Needs vLLM on CPU (``tools/install_vllm_cpu.sh``); ``.ci/run`` runs this file
after installing it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.selftest.support.scratch_trees import NEEDS_VLLM_AND_SEED, ROOT, replace_in_tree, seed_tree

ATTENTION = "vllm/models/deepseek_v41/attention.py"
DISTRIBUTED_IMPORT = "from vllm.distributed import get_pcp_group, get_tensor_model_parallel_world_size\n"
SINK_LINE = "        self.attn_sink = make_attention_sink(self.padded_heads, torch.float32)\n"
# What a DCP2 stack's DeepseekV4Attention.__init__ could set: the interleave in compressed states.
STACK_DCP_ATTRIBUTES = (
    "        self.dcp_world_size = get_dcp_group().world_size\n"
    "        self.dcp_rank = get_dcp_group().rank_in_group\n"
    "        self.cp_kv_cache_interleave_size = (\n"
    "            vllm_config.parallel_config.cp_kv_cache_interleave_size // max(self.compress_ratio, 1)\n"
    "        )\n"
)
REPORT = """
import json
from dcpcheck.impls.dsv41.implementation import Dsv41Implementation
from dcpcheck.impls.dsv41.findings.stand_ins import MANIFEST
impl = Dsv41Implementation()
group = next(entry for entry in MANIFEST if entry.piece == "the DCP group")
print(json.dumps({"line": MANIFEST[1].line(impl), "read_unit": impl.findings.read_unit, "group": group.line(impl)}))
"""

pytestmark = NEEDS_VLLM_AND_SEED


def _tree(folder: Path, stack_sets_dcp: bool) -> Path:
    tree = seed_tree(folder)
    if stack_sets_dcp:
        replace_in_tree(tree, ATTENTION, SINK_LINE, STACK_DCP_ATTRIBUTES + SINK_LINE)
        replace_in_tree(
            tree, ATTENTION, DISTRIBUTED_IMPORT, "from vllm.distributed import get_dcp_group\n" + DISTRIBUTED_IMPORT
        )
    return tree


def _report(tree: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, "-c", REPORT], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("stack_sets_dcp", [False, True], ids=["seed_tree", "stack_sets_the_dcp_attributes"])
def test_the_trees_dcp_attributes_replace_the_stand_in(tmp_path, stack_sets_dcp):
    report = _report(_tree(tmp_path / "tree", stack_sets_dcp))
    if stack_sets_dcp:
        assert report["line"].startswith(
            "the layer's dcp_world_size, dcp_rank, cp_kv_cache_interleave_size: the tree's"
        )
        assert report["read_unit"] is None, report["read_unit"]
    else:
        assert ": stand-in, set from the DCP group" in report["line"]
        assert "elsewhere than they were written" in report["read_unit"]
    # Either tree: the layer's DCP group is the tree's GroupCoordinator, its communicator named.
    assert report["group"].startswith(
        "the DCP group: the tree's (distributed/parallel_state.py GroupCoordinator, collectives through "
        "distributed/device_communicators/"
    ), report["group"]
