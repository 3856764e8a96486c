"""Issue 56's setup-path, agreement and start-up classes on scratch trees: each dsv41
probe test passes on the seed tree where the seed is right, fails where a plant in the port's
own file breaks it, and passes where a plant fixes what the seed gets wrong.

* ``capture_builds_global_slots`` (the GB10 bring-up's capture builder without DCP-local
  metadata): the DSV4.1 metadata builder's ``build_for_cudagraph_capture`` builds from every
  global token's slot; ``test_captured_metadata_is_the_real_steps`` fails;
* ``padded_local_heads_served`` (SGLang's late head-count checks): the layer's refusal of a
  padded local head count is gone; ``test_port_refuses_the_head_counts_it_cannot_combine`` fails;
* ``one_backend_for_every_rank`` (vllm #48248's per-rank decision, fixed): both backends are
  taken from no process's environment, so every rank issues the same collectives;
  ``test_ranks_with_different_backends_agree_or_refuse`` passes (on the seed: an expected failure).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.selftest.support.scratch_trees import NEEDS_VLLM_AND_SEED, replace_in_tree, run_dsv41, seed_tree

pytestmark = NEEDS_VLLM_AND_SEED

PORT_FILE = "vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py"
CAPTURE = "tests/stage1_index/test_tree_capture_metadata.py::test_captured_metadata_is_the_real_steps"
HEAD_COUNTS = "tests/stage3_combine/test_tree_head_counts.py::test_port_refuses_the_head_counts_it_cannot_combine"
AGREEMENT = "tests/stage3_combine/test_tree_backend_agreement.py::test_ranks_with_different_backends_agree_or_refuse"
BUILDER_INIT = (
    "    def __init__(self, *args, **kwargs):\n        super().__init__(*args, **kwargs)\n        # DCP port staging"
)


@dataclass(frozen=True)
class Plant:
    name: str
    edits: tuple[tuple[str, str], ...]  # (its one occurrence in the seed tree's port file, the planted text)
    test: str
    shows: tuple[str, ...]  # in the session's output (its summary line, and why)


PLANTS = (
    Plant(
        "capture_builds_global_slots",
        (
            (
                BUILDER_INIT,
                "    def build_for_cudagraph_capture(self, common_attn_metadata):\n"
                "        common_attn_metadata.slot_mapping = torch.arange(common_attn_metadata.slot_mapping.numel())\n"
                "        return self.build(0, common_attn_metadata)\n\n" + BUILDER_INIT,
            ),
        ),
        CAPTURE,
        ("1 failed", "graph-capture metadata: ", "rank 0: slot_mapping; rank 1: slot_mapping"),
    ),
    Plant(
        "padded_local_heads_served",
        (("            if self.padded_heads != self.n_local_heads:", "            if False:"),),
        HEAD_COUNTS,
        ("1 failed", "DCP head counts: builds a layer at W=2 with 4 local heads"),
    ),
    Plant(
        "one_backend_for_every_rank",
        (
            (
                'self._dcp_combine_a2a = os.environ.get("DSV41_DCP_COMBINE", "ag_rs") == "a2a"',
                "self._dcp_combine_a2a = False",
            ),
            (
                '_DCP_PREFILL_GATHER = os.environ.get("DSV41_DCP_PREFILL_GATHER", "0") == "1"',
                "_DCP_PREFILL_GATHER = False",
            ),
        ),
        AGREEMENT,
        ("1 passed",),
    ),
)


@pytest.mark.parametrize("plant", PLANTS, ids=lambda plant: plant.name)
def test_a_plant_turns_the_probe_test(tmp_path, plant):
    tree = seed_tree(tmp_path / "tree")
    for correct, planted in plant.edits:
        replace_in_tree(tree, PORT_FILE, correct, planted)
    done = run_dsv41(tree, plant.test, 1)  # the probes run at W = 1: one process asks each rank
    missing = [text for text in plant.shows if text not in done.stdout]
    assert not missing, f"{missing} not in: {done.stdout[-4000:]}"
