"""``--dcp-impl dsv41`` serves block tables as wide as vLLM's (a rank's
compressed row covers ``max_model_len / W``: :func:`dcpcheck.impls.dsv41.serving.block_table_width`)
and its far-end trace has requests that reach the last page of every rank's row:
a porter's stack whose page bound is taken on the global page number instead of
the rank's (here the bound of vLLM's top-k remap kernel,
``sparse_mla_index_remap_kernel`` in ``sparse_utils.py``, which the port's DCP
decode calls) drops the states only long requests have, and fails that trace;
the seed tree passes it. A row as wide as ``max_model_len`` pages, W times
vLLM's, hid that bug."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.selftest.inner import inner_env
from tests.selftest.scratch_trees import NEEDS_VLLM_AND_SEED, ROOT, replace_in_tree, seed_tree

pytestmark = NEEDS_VLLM_AND_SEED

REMAP_KERNEL = "vllm/v1/attention/backends/mla/sparse_utils.py"
LOCAL_PAGE_BOUND = "valid_block = (block_id < max_num_blocks_per_req) & (block_id >= 0)"
GLOBAL_PAGE_BOUND = "valid_block = (tok // BLOCK_SIZE < max_num_blocks_per_req) & (block_id >= 0)"
TRACE = "tests/e2e/test_serving_trace.py::test_dsv41_far_end_trace[W2]"


@pytest.mark.parametrize("global_bound", [False, True], ids=["seed_tree", "bound_on_the_global_page"])
def test_a_bound_on_the_global_page_fails(tmp_path, global_bound):
    tree = seed_tree(tmp_path / "tree")
    if global_bound:
        replace_in_tree(tree, REMAP_KERNEL, LOCAL_PAGE_BOUND, GLOBAL_PAGE_BOUND)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--dcp-impl", "dsv41"]
    command += ["--dcp-timeout", "900", "--world-sizes", "2", TRACE]
    env = inner_env(PYTHONPATH=f"{tree}:{ROOT}", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if global_bound:
        assert done.returncode == 1 and "1 failed" in done.stdout, done.stdout[-4000:]
        assert "MismatchError: DCP-W vs float64 oracle" in done.stdout, done.stdout[-4000:]
        # The first compressed layer, at a decode of the request that reaches max_model_len.
        assert "layer=1 (rho 1)" in done.stdout and "[decode, uid 0, position" in done.stdout, done.stdout[-4000:]
    else:
        assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-4000:]
