"""``torchrun -m pytest``: in-process ranks agree on every outcome, only rank
0 reports, and a rank failing before a collective does not hang the job."""

from __future__ import annotations

import sys

import pytest

from tests.selftest.inner import inner_env, write_session

pytestmark = pytest.mark.spawned_only

TORCHRUN_TESTS = """
import pytest
from tests.selftest.rank_functions import raise_on_rank, sum_of_ranks

def test_passes(dcp):
    dcp.run(sum_of_ranks)

@pytest.mark.parametrize("before_collective", [False, True])
def test_rank_one_fails(dcp, before_collective):
    dcp.run(raise_on_rank, bad_rank=1, before_collective=before_collective)

def test_passes_after_failures(dcp):
    dcp.run(sum_of_ranks)
"""


def test_torchrun_ranks_agree_and_only_rank_zero_reports(tmp_path):
    import subprocess

    write_session(tmp_path, {"test_torchrun.py": TORCHRUN_TESTS})
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--tee", "3",
        "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfs", "--dcp-timeout", "5", "test_torchrun.py",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=inner_env(), capture_output=True, text=True, timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    # Each rank ran all 4 tests with the same outcomes; only rank 0 printed its summary.
    assert output.count("2 failed, 2 passed") == 1, output
    rank_one_errors = [line for line in output.splitlines() if "[rank 1] ValueError: planted failure on rank 1" in line]
    assert rank_one_errors, output
    # Rank 1 failed before the collective: rank 0's collective timed out after
    # --dcp-timeout and both ranks reported, instead of hanging.
    assert "failing ranks [0, 1]" in output and "Timed out" in output, output
