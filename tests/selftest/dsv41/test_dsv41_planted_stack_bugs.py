"""Bugs a porter's merge plants in vLLM files of the DCP2 stack other than the
port's, each failing the dsv41 test that reaches it, where the seed tree passes
that test. A plant is data: the file, its one correct text and the planted
one, the test and world size that reach it, and what the failure must show.

* ``window_off_by_a_page``: the SWA builder's page index one page on
  (``_compute_swa_indices_and_lens_kernel`` in ``sparse_swa.py``), read by the
  trace's SWA-only first layer (:mod:`dcpcheck.impls.dsv41.server.swa_pages`);
* ``bound_on_the_global_page``: the top-k remap kernel's page bound
  (``sparse_mla_index_remap_kernel`` in ``sparse_utils.py``, which the port's
  DCP decode calls) taken on the global page instead of the rank's: only a
  request past ``max_model_len / W`` loses states, and only a block-table row
  as wide as vLLM's (``serving.block_table_width``) shows it; one W times
  wider hid it;
* ``gathered_ranks_interleaved``: the device communicator's all-gather
  (``DeviceCommunicatorBase.all_gather`` in ``base_device_communicator.py``)
  moving the rank blocks one dim too far, so they interleave: the layer's DCP
  group is the tree's ``GroupCoordinator`` over that communicator
  (:mod:`dcpcheck.impls.dsv41.server.coordinator`), and the port gathers its query
  heads (and sink) through it; on dcpcheck's own group it went unseen;
* ``a2a_on_the_cpu_group``: vLLM's a2a combine (``dcp_a2a_lse_reduce`` in
  ``dcp.py``) sending its partials over the coordinator's ``cpu_group``: the
  same numbers over gloo, host-staged and not capturable on an NCCL server;
  unseen while one gloo group was both
  (:mod:`dcpcheck.impls.dsv41.server.group_guard`);
* ``token_offset_of_one_rank``: the runner's token slot mapping
  (``ComputeSlotMappingKernel`` in ``block_table.py``) giving each token its
  offset in the W-rank virtual page, not in its rank's page: only at W > 1,
  where the writer stand-in of finding 4 writes instead of the tree's builder
  (:mod:`dcpcheck.impls.dsv41.server.token_slots`);
* ``indexer_refuses_without_dcp``: the indexer builder's DCP refusal
  (``DeepseekV32IndexerMetadataBuilder.__init__`` in ``indexer.py``) taken at
  W = 1 too, so a server without DCP at vLLM's default 1-token interleave
  would not start; the refusal probe built the builder at W = 2 only."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.selftest.support.scratch_trees import NEEDS_VLLM_AND_SEED, replace_in_tree, run_dsv41, seed_tree

pytestmark = NEEDS_VLLM_AND_SEED


@dataclass(frozen=True)
class PlantedStackBug:
    name: str
    file: str  # vllm/..., a file of the stack other than the port's
    correct: str  # its one occurrence in vLLM 0.33.0
    planted: str
    test: str  # the suite test that reaches it
    world_size: int
    shows: tuple[str, ...]  # in the failing session's output


PLANTS = (
    PlantedStackBug(
        "window_off_by_a_page",
        "vllm/v1/attention/backends/mla/sparse_swa.py",
        # The causal window kernel's page index: the only one at its indentation (the other is a loop deeper).
        "\n        block_indices = pos_offset // block_size\n",
        "\n        block_indices = pos_offset // block_size + 1\n",
        "tests/e2e/test_serving_trace.py::test_dsv41_ratio1_trace[W1-stage3_chunked]",
        1,
        # The trace's first layer is SWA-only: nothing but the window to read.
        ("MismatchError: DCP-W vs float64 oracle", "step=0 layer=0 (rho 0)"),
    ),
    PlantedStackBug(
        "bound_on_the_global_page",
        "vllm/v1/attention/backends/mla/sparse_utils.py",
        "valid_block = (block_id < max_num_blocks_per_req) & (block_id >= 0)",
        "valid_block = (tok // BLOCK_SIZE < max_num_blocks_per_req) & (block_id >= 0)",
        "tests/e2e/test_serving_trace.py::test_dsv41_far_end_trace[W2]",
        2,
        # The first compressed layer, at a decode of the request that reaches max_model_len.
        ("MismatchError: DCP-W vs float64 oracle", "layer=1 (rho 1)", "[decode, uid 0, position"),
    ),
    PlantedStackBug(
        "gathered_ranks_interleaved",
        "vllm/distributed/device_communicators/base_device_communicator.py",
        # all_gather's move of the rank dim onto the gathered one (reduce_scatter's read input_/output_tensor).
        "\n        output_tensor = output_tensor.movedim(0, dim)\n",
        "\n        output_tensor = output_tensor.movedim(0, dim + 1)\n",
        "tests/e2e/test_serving_trace.py::test_dsv41_ratio1_trace[W2-stage3_chunked]",
        2,
        # The first layer with a DCP path (layer 0 is SWA-only: the DCP1 path, no collective).
        ("MismatchError: DCP-W vs float64 oracle", "layer=1 (rho 1)"),
    ),
    PlantedStackBug(
        "a2a_on_the_cpu_group",
        "vllm/v1/attention/ops/dcp.py",
        "\n        send_buffer.view(-1),\n        group=cp_group.device_group,\n",
        "\n        send_buffer.view(-1),\n        group=cp_group.cpu_group,\n",
        "tests/e2e/test_serving_trace.py::test_dsv41_ratio1_trace[W2-stage3_chunked]",
        2,
        ("WrongGroupError: torch.distributed.all_to_all_single issued on the DCP GroupCoordinator's cpu_group",),
    ),
    PlantedStackBug(
        "token_offset_of_one_rank",
        "vllm/v1/worker/block_table.py",
        "// (TOTAL_CP_WORLD_SIZE * CP_KV_CACHE_INTERLEAVE_SIZE)",
        "// CP_KV_CACHE_INTERLEAVE_SIZE",
        "tests/e2e/test_serving_trace.py::test_dsv41_ratio1_trace[W2-stage3_chunked]",
        2,
        ("MismatchError: the tree's token slot mapping", "at W=2"),
    ),
    PlantedStackBug(
        "indexer_refuses_without_dcp",
        "vllm/v1/attention/backends/mla/indexer.py",
        "\n            self.dcp_world_size > 1\n            and self.compress_ratio > 1\n",
        "\n            self.dcp_world_size >= 1\n            and self.compress_ratio > 1\n",
        "tests/stage1_index/test_tree_placement.py::test_tree_refuses_dcp_where_dcpchecks_model_does",
        1,
        ("MismatchError: indexer's DCP refusal", "W=1, ratio 2, 1-token interleave: the tree refuses it"),
    ),
)


@pytest.mark.parametrize("plant", PLANTS, ids=lambda plant: plant.name)
def test_the_seed_tree_passes_the_test_that_reaches_the_plant(tmp_path, plant):
    done = run_dsv41(seed_tree(tmp_path / "tree"), plant.test, plant.world_size)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-4000:]


@pytest.mark.parametrize("plant", PLANTS, ids=lambda plant: plant.name)
def test_a_planted_stack_bug_fails_the_test_that_reaches_it(tmp_path, plant):
    tree = seed_tree(tmp_path / "tree")
    replace_in_tree(tree, plant.file, plant.correct, plant.planted)
    done = run_dsv41(tree, plant.test, plant.world_size)
    assert done.returncode == 1 and "1 failed" in done.stdout, done.stdout[-4000:]
    missing = [text for text in plant.shows if text not in done.stdout]
    assert not missing, f"{missing} not in: {done.stdout[-4000:]}"
