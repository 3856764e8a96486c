"""Held-out bugs of the port's own file that the small model let through, each a porter's one-line
merge mistake, now failing the dsv41 test that reaches it, where the seed tree passes that test
(issue 52, item 4). A plant is data, as in ``test_dsv41_planted_stack_bugs.py``.

* ``cache_format_names_the_v41_record`` / ``scale_format_names_the_v41_record``: the SM120
  wrapper's ``kv_cache_format`` or ``kv_scale_format`` argument naming DeepSeek-V4.1's 528-byte
  record (a merge from a V4.1-mxfp8 branch) where the caches hold the DSV4 record: the kernel
  reads the record the arguments name, so it would misread the cache. FlashInfer's stand-in once
  accepted any value of the entry's ``Literal`` and never read ``kv_scale_format``; it now checks
  both against the record the caches hold (:mod:`dcpcheck.impls.dsv41.kernels.record_formats`);
* ``remapped_slots_left_int64``: the gathered prefill's remap without its ``.to(torch.int32)``,
  its int64 slots handed to the DCP1 path's kernel name. That name was bound straight to the
  reference kernel, which reads any integer dtype; it is now FlashInfer's public entry with its
  argument checks (:mod:`dcpcheck.impls.dsv41.kernels.flashinfer_dsv4_entry`), which refuses
  indices that are not int32;
* ``heads_set_without_128``: the port's sparse-MLA head set copied as ``(8, 16, 32, 64)``, the set
  FlashInfer's V4.1 forms list for dual-cache prefill, so a layer the kernel sees with 128 heads
  (TP 1, or 64 a rank gathered by DCP 2) cannot be built; the suite's 8 heads a rank never met it,
  ``test_dsv41_128_kernel_heads`` does (issue 52, item 4(b))."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.selftest.support.scratch_trees import NEEDS_VLLM_AND_SEED, replace_in_tree, run_dsv41, seed_tree

pytestmark = NEEDS_VLLM_AND_SEED

PORT_FILE = "vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py"
RATIO1_DCP_DECODE = "tests/e2e/test_serving_trace.py::test_dsv41_ratio1_trace[W2-stage3_chunked]"
RATIO1_GATHER = "tests/e2e/test_serving_trace.py::test_dsv41_ratio1_trace[W2-gather]"
KERNEL_HEADS_128 = "tests/e2e/test_serving_trace.py::test_dsv41_128_kernel_heads[W2]"


@dataclass(frozen=True)
class HeldOutBug:
    name: str
    correct: str  # its one occurrence in the seed tree's port file
    planted: str
    test: str  # the suite test that reaches it
    world_size: int
    shows: tuple[str, ...]  # in the failing session's output


PLANTS = (
    HeldOutBug(
        "cache_format_names_the_v41_record",
        '        kv_cache_format="fp8",\n',
        '        kv_cache_format="fp8_dsv41",\n',
        RATIO1_DCP_DECODE,
        2,
        ("kv_cache_format='fp8_dsv41' names the DeepSeek-V4.1 record", "holds the DSV4 record"),
    ),
    HeldOutBug(
        "scale_format_names_the_v41_record",
        '        kv_scale_format="auto",\n',
        '        kv_scale_format="ue8m0_g32",\n',
        RATIO1_DCP_DECODE,
        2,
        ("kv_scale_format='ue8m0_g32' names the DeepSeek-V4.1 record", "holds the DSV4 record"),
    ),
    HeldOutBug(
        "remapped_slots_left_int64",
        "slots = torch.where(valid, slot, torch.full_like(slot, -1)).to(torch.int32)",
        "slots = torch.where(valid, slot, torch.full_like(slot, -1))",
        RATIO1_GATHER,
        2,
        ("sparse_mla_segments[1].indices must have dtype torch.int32, got torch.int64",),
    ),
    HeldOutBug(
        "heads_set_without_128",
        "_SPARSE_MLA_SUPPORTED_Q_HEADS = (8, 16, 32, 64, 128)",
        "_SPARSE_MLA_SUPPORTED_Q_HEADS = (8, 16, 32, 64)",
        KERNEL_HEADS_128,
        2,
        ("does not support 128 heads",),
    ),
)


@pytest.mark.parametrize("test", sorted({plant.test for plant in PLANTS}))
def test_the_seed_tree_passes_the_tests_that_reach_the_plants(tmp_path, test):
    done = run_dsv41(seed_tree(tmp_path / "tree"), test, 2)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-4000:]


@pytest.mark.parametrize("plant", PLANTS, ids=lambda plant: plant.name)
def test_a_held_out_port_bug_fails_the_test_that_reaches_it(tmp_path, plant):
    tree = seed_tree(tmp_path / "tree")
    replace_in_tree(tree, PORT_FILE, plant.correct, plant.planted)
    done = run_dsv41(tree, plant.test, plant.world_size)
    assert done.returncode == 1 and "1 failed" in done.stdout, done.stdout[-4000:]
    missing = [text for text in plant.shows if text not in done.stdout]
    assert not missing, f"{missing} not in: {done.stdout[-4000:]}"
