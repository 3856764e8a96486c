"""Each pool's zygote loads the implementation once, before it forks the
ranks (vLLM's import is seconds of CPU per rank), on CPU and on CUDA; an
implementation whose import initialises CUDA is loaded by each rank after
its fork instead, and its cases run (``dcpcheck/ranks/worker.py``, ``_preload``)."""

from __future__ import annotations

import pytest

from tests.selftest.inner import run_inner_pytest, write_session

pytestmark = pytest.mark.spawned_only

# Records the process that imported it; initialises CUDA at import where asked.
RECORDING_IMPL = """
import os

from dcpcheck.port.impl import EmbeddedPort

IMPORTED_IN = os.getpid()
if os.environ.get("INIT_CUDA_AT_IMPORT") == "1":
    import torch

    torch.zeros(1, device="cuda")


class Recording(EmbeddedPort):
    name = "recording"
"""

TESTS = """
import os
import sys

import pytest

from tests.selftest.rank_functions import sum_of_ranks


def loaded_in(ctx) -> str:
    module = sys.modules[type(ctx.impl).__module__]
    return "rank" if module.IMPORTED_IN == os.getpid() else "zygote"


@pytest.mark.world_sizes(2)
def test_loaded_where_expected(dcp):
    assert dcp.run(loaded_in) == [os.environ["EXPECT_LOADED_IN"]] * 2
    dcp.run(sum_of_ranks)
"""


def _run(tmp_path, **env) -> tuple[int, str]:
    write_session(tmp_path, {"test_inner.py": TESTS, "recording.py": RECORDING_IMPL})
    return run_inner_pytest(tmp_path, ["--dcp-impl", "recording.py:Recording", "--world-sizes", "2"], **env)


def test_the_zygote_loads_the_implementation_before_forking(tmp_path):
    code, output = _run(tmp_path, EXPECT_LOADED_IN="zygote")
    assert code == 0 and "1 passed" in output, output


@pytest.mark.gpu
def test_an_implementation_that_initialises_cuda_at_import_is_loaded_by_each_rank(tmp_path):
    code, output = _run(tmp_path, EXPECT_LOADED_IN="rank", INIT_CUDA_AT_IMPORT="1")
    assert code == 0 and "1 passed" in output, output
