"""``--dcp-impl dsv41`` serves the sliding window through pages of DSV4.1's SWA
block size, with the tree's own SWA metadata builder (:mod:`dcpcheck.impls.dsv41.swa_pages`):
a porter's stack whose window read is off by one page (here the builder's page
index, ``_compute_swa_indices_and_lens_kernel`` in ``sparse_swa.py``) fails a
dsv41 trace; the seed tree passes it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.selftest.inner import inner_env
from tests.selftest.scratch_trees import NEEDS_VLLM_AND_SEED, ROOT, replace_in_tree, seed_tree

pytestmark = NEEDS_VLLM_AND_SEED

SWA_BUILDER = "vllm/v1/attention/backends/mla/sparse_swa.py"
# The causal window kernel's page index: the only one indented at its level (the other is a loop deeper).
PAGE_INDEX = "\n        block_indices = pos_offset // block_size\n"
OFF_BY_A_PAGE = "\n        block_indices = pos_offset // block_size + 1\n"
TRACE = "tests/e2e/test_serving_trace.py::test_dsv41_ratio1_trace[W1-stage3_chunked]"


@pytest.mark.parametrize("off_by_a_page", [False, True], ids=["seed_tree", "window_off_by_a_page"])
def test_a_window_read_off_by_a_page_fails(tmp_path, off_by_a_page):
    tree = seed_tree(tmp_path / "tree")
    if off_by_a_page:
        replace_in_tree(tree, SWA_BUILDER, PAGE_INDEX, OFF_BY_A_PAGE)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--dcp-impl", "dsv41"]
    command += ["--dcp-timeout", "900", "--world-sizes", "1", TRACE]
    env = inner_env(PYTHONPATH=f"{tree}:{ROOT}", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if off_by_a_page:
        assert done.returncode == 1 and "1 failed" in done.stdout, done.stdout[-4000:]
        # The trace's first layer is SWA-only: nothing but the window to read.
        assert "MismatchError: DCP-W vs float64 oracle" in done.stdout, done.stdout[-4000:]
        assert "step=0 layer=0 (rho 0)" in done.stdout, done.stdout[-4000:]
    else:
        assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-4000:]
