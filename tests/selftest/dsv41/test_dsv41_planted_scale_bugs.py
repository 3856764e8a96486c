"""Scale bugs planted in the port and in vLLM's DCP kernels: each passes a small-profile test that reaches
its code and fails the production profile's logic (``test_production_logic_small``: positions past 2^17,
vLLM's block-table rows at that max_model_len, top-k 2048, the compressed cache's pages past 2^31 bytes
of its KV pool), on CPU. A plant is data: the file, its one correct text and the planted one, the small
test that reaches it, the world size, and what the production failure must show.

* ``int32_byte_offset``: the port's prefill gather (``_dcp_prefill_gather``) takes each page through its
  byte offset computed on the int32 block table: it wraps once a page sits past 2^31 bytes;
* ``position_in_int16``: vLLM's SWA window kernel (``_compute_swa_indices_and_lens_kernel``,
  ``sparse_swa.py``) takes a position's page in int16: it wraps past 2^15 tokens, which the production
  positions (past 2^17) pass and the small profile's never do;
* ``topk_cut_at_1024``: the port's gather remap reads the first 1024 top-k columns: only top-k 2048 loses ids;
* ``table_cut_at_256``: vLLM's DCP top-k remap kernel (``sparse_mla_index_remap_kernel``,
  ``sparse_utils.py``) bounds a block-table column at 256: only rows wider than the small profile's
  (vLLM's at max_model_len 2^17 + 4096 and W = 2: 528 columns) lose their far pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.selftest.support.scratch_trees import NEEDS_VLLM_AND_SEED, replace_in_tree, run_dsv41_nodes, seed_tree

pytestmark = NEEDS_VLLM_AND_SEED

PRODUCTION_LOGIC = "tests/production/test_production.py::test_production_logic_small"


def production_logic(world_size: int) -> str:
    """The production logic case at ratio 1 (at ratio 2 and W > 1 finding 1 shows first)."""
    return f"{PRODUCTION_LOGIC}[W{world_size}-rho1]"


PORT = "vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py"


@dataclass(frozen=True)
class ScaleBug:
    name: str
    file: str  # vllm/...
    correct: str  # its one occurrence in the seed tree
    planted: str
    small_test: str  # a small-profile test that reaches the plant, at world_size
    world_size: int
    shows: tuple[str, ...]  # in the production case's failure

    @property
    def production(self) -> str:
        return production_logic(self.world_size)


PLANTS = (
    ScaleBug(
        "int32_byte_offset",
        PORT,
        "page_ids = attn_metadata.block_table[num_decodes + i, :p].long()",
        "page_ids = (attn_metadata.block_table[num_decodes + i, :p] * pool.stride(0)).long() // pool.stride(0)",
        "tests/e2e/test_serving_trace.py::test_dsv41_ratio1_trace[W2-gather]",
        2,
        ("_dcp_prefill_gather",),
    ),
    ScaleBug(
        "position_in_int16",
        "vllm/v1/attention/backends/mla/sparse_swa.py",
        # The causal window kernel's page index: the only one at its indentation.
        "\n        block_indices = pos_offset // block_size\n",
        "\n        block_indices = pos_offset.to(tl.int16) // block_size\n",
        "tests/e2e/test_serving_trace.py::test_dsv41_ratio1_trace[W1-stage3_chunked]",
        1,
        ("MismatchError: production step vs float64 oracle",),
    ),
    ScaleBug(
        "topk_cut_at_1024",
        PORT,
        "ids = topk_indices.long()",
        "ids = topk_indices[:, :1024].long()",
        "tests/e2e/test_serving_trace.py::test_dsv41_ratio1_trace[W2-gather]",
        2,
        ("MismatchError: production step vs float64 oracle", "prefill, request 3"),
    ),
    ScaleBug(
        "table_cut_at_256",
        "vllm/v1/attention/backends/mla/sparse_utils.py",
        "valid_block = (block_id < max_num_blocks_per_req) & (block_id >= 0)",
        "valid_block = (block_id < tl.minimum(max_num_blocks_per_req, 256)) & (block_id >= 0)",
        "tests/e2e/test_serving_trace.py::test_dsv41_far_end_trace[W2]",
        2,
        ("MismatchError: production step vs float64 oracle", "spec-decode, request 0"),
    ),
)


def test_the_seed_tree_passes_the_production_logic(tmp_path):
    done = run_dsv41_nodes(seed_tree(tmp_path / "tree"), [production_logic(1), production_logic(2)], "1,2")
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout[-4000:]


@pytest.mark.parametrize("plant", PLANTS, ids=lambda plant: plant.name)
def test_a_scale_bug_passes_the_small_profile_and_fails_the_production_one(tmp_path, plant):
    tree = seed_tree(tmp_path / "tree")
    replace_in_tree(tree, plant.file, plant.correct, plant.planted)
    done = run_dsv41_nodes(tree, [plant.small_test, plant.production], str(plant.world_size))
    assert done.returncode == 1 and "1 failed, 1 passed" in done.stdout, done.stdout[-4000:]
    assert f"FAILED {plant.production}" in done.stdout, done.stdout[-4000:]
    missing = [text for text in plant.shows if text not in done.stdout]
    assert not missing, f"{missing} not in: {done.stdout[-4000:]}"
