"""``torchrun -m pytest`` ranks that disagree (issue 39): ranks that differ
in what decides a case are one usage error before the first case; a start-up
that never returns is bounded; a known defect of the implementation's own
class crosses ranks as plain data; no rank aborts at exit after its report."""

from __future__ import annotations

import shlex
import sys

import pytest

from tests.selftest.support.inner import inner_env, run_python_module, write_session

pytestmark = pytest.mark.spawned_only

# A hang before the fix is this test's failure, not its session's.
TORCHRUN_TIMEOUT_S = 90

TESTS = """
import pytest
from tests.selftest.support.rank_functions import raise_on_rank, sum_of_ranks

@pytest.mark.stage(3)
@pytest.mark.world_sizes(2)
def test_staged(dcp):
    dcp.run(sum_of_ranks)

@pytest.mark.world_sizes(2)
def test_plain(dcp):
    dcp.run(sum_of_ranks)

@pytest.mark.world_sizes(2)
def test_known_defect(dcp):
    dcp.run(raise_on_rank, bad_rank=1, before_collective=False)
"""

# Replaces init_process_group as it loads: the start-up never returns.
HANGING_INIT_IMPL = """
import time

import torch.distributed as dist

from dcpcheck.port.impl import EmbeddedPort


def never_returns(*args, **kwargs):
    time.sleep(3600)


dist.init_process_group = never_returns


class HangingInit(EmbeddedPort):
    name = "hanging-init"
"""

# Its known defect is of a class of its own, made per call: it cannot be
# pickled, let alone unpickled on another rank.
OWN_KNOWN_FAILURE_IMPL = """
from dcpcheck.impls.protocol import KnownFailure
from dcpcheck.port.impl import EmbeddedPort


class OwnKnownFailure(EmbeddedPort):
    name = "own-known-failure"

    def known_defect(self, terms):
        class PlantedDefect(KnownFailure):
            pass

        return PlantedDefect("rank 1 fails on purpose", "planted failure on rank 1")
"""

# Rank 1's case thread is left in a collective (rank 0 sleeps in Python);
# rank 1's interpreter then finalizes for 5 s and rank 0's process ends 1.5 s
# into that, which wakes the stranded thread while rank 1 finalizes.
STRANDED_TESTS = """
import atexit
import os
import time

import pytest
from tests.selftest.support.hostile import sleep_on_rank
from tests.selftest.support.rank_functions import sum_of_ranks


class SlowToFinalize:
    def __del__(self, sleep=time.sleep):  # bound now: the module's globals are gone by then
        sleep(5)


if os.environ["RANK"] == "1":
    SLOW = SlowToFinalize()
else:
    atexit.register(time.sleep, 1.5)


@pytest.mark.world_sizes(2)
def test_stuck(dcp):
    dcp.run(sleep_on_rank, bad_rank=0)


@pytest.mark.world_sizes(2)
def test_after(dcp):
    dcp.run(sum_of_ranks)
"""


def _torchrun(tmp_path, pytest_args: list[str], *, rank_one_prefix: str = "", rank_one_args: str = "") -> str:
    """Output of a 2-rank torchrun job running pytest; rank 1's process runs
    with ``rank_one_prefix`` (environment assignments) and ``rank_one_args``."""
    pytest_cmd = shlex.join([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfsx", *pytest_args])
    script = f'if [ "$RANK" = 1 ]; then exec env {rank_one_prefix} {pytest_cmd} {rank_one_args}; fi; exec {pytest_cmd}'
    launcher = ["--nproc-per-node", "2", "--tee", "3", "--no-python", "sh", "-c", script]
    code, output = run_python_module(
        tmp_path, "torch.distributed.run", launcher, env=inner_env(), timeout=TORCHRUN_TIMEOUT_S
    )
    if code is None:
        raise AssertionError(f"the torchrun job did not end within {TORCHRUN_TIMEOUT_S} s:\n{output}")
    return output


def _root_cause(output: str) -> tuple[str, str] | None:
    """(rank, exit code) of the rank torchrun names as the job's root cause; None when every rank exited 0."""
    if "Root Cause" not in output:
        return None
    fields = dict(line.strip().split(":", 1) for line in output.split("Root Cause", 1)[1].splitlines() if " : " in line)
    return fields["rank      "].split()[0], fields["exitcode  "].split()[0]


def test_ranks_differing_in_stage_and_tests_are_one_usage_error(tmp_path):
    write_session(tmp_path, {"test_inner.py": TESTS})
    output = _torchrun(
        tmp_path, ["test_inner.py"], rank_one_prefix="DSV41_DCP_STAGE=1", rank_one_args="-k 'not known_defect'"
    )
    error = (
        "ERROR: torchrun: the ranks differ in what decides a case (DSV41_DCP_STAGE: rank 0: unset; rank 1: '1' | "
        "collected tests: rank 0: 3 collected (test_inner.py::test_known_defect[W2] not on every rank); "
        "rank 1: 2 collected); launch every rank with the same environment, options and tests"
    )
    assert output.count(error) == 1 and f"[default0]:{error}" in output, output  # rank 0's, once
    assert _root_cause(output) == ("0", "4"), output  # rank 0's usage error; rank 1 ended quietly
    assert "[default0]:no tests ran" in output, output


def test_options_differing_between_ranks_are_named_with_their_values():
    from dcpcheck.ranks.torchrun import describe_disagreement

    by_rank = {
        rank: {"--dcp-impl": "port", "--dcp-seed": seed, "collected tests": ["a", "b"]}
        for rank, seed in enumerate([0, 7, 0])
    }
    by_rank[2]["collected tests"] = ["b", "a"]
    assert describe_disagreement(by_rank) == (
        "torchrun: the ranks differ in what decides a case (--dcp-seed: ranks 0, 2: 0; rank 1: 7 | "
        "collected tests: ranks 0, 1: 2 collected (in another order); rank 2: 2 collected (in another order)); "
        "launch every rank with the same environment, options and tests"
    )
    by_rank[2] = by_rank[0]
    by_rank[1] = by_rank[0]
    assert describe_disagreement(by_rank) is None


def test_start_up_that_never_returns_is_bounded_and_named(tmp_path):
    write_session(tmp_path, {"test_inner.py": TESTS, "hanging_init.py": HANGING_INIT_IMPL})
    output = _torchrun(
        tmp_path, ["--dcp-impl", "hanging_init.py:HangingInit", "--dcp-startup-timeout", "3", "test_inner.py"]
    )
    assert (
        "[default0]:ERROR: torchrun: torch.distributed.init_process_group(backend='gloo') on rank 0, "
        "joining the 2 ranks at "
    ) in output, output
    assert "did not return within 3 s (--dcp-startup-timeout); it waits in never_returns (hanging_init.py:" in output
    assert "[default1]:ERROR" not in output, output
    assert _root_cause(output) == ("0", "4"), output


def test_known_defect_of_the_implementations_own_class_crosses_ranks(tmp_path):
    write_session(tmp_path, {"test_inner.py": TESTS, "own_known_failure.py": OWN_KNOWN_FAILURE_IMPL})
    output = _torchrun(
        tmp_path, ["--dcp-impl", "own_known_failure.py:OwnKnownFailure", "-k", "known_defect", "test_inner.py"]
    )
    assert "[default0]:XFAIL test_inner.py::test_known_defect[W2] - known defect of" in output, output
    assert _root_cause(output) is None, output  # every rank exited 0


def test_rank_with_a_thread_left_in_a_collective_exits_cleanly(tmp_path):
    write_session(tmp_path, {"test_inner.py": STRANDED_TESTS})
    output = _torchrun(tmp_path, ["--dcp-timeout", "3", "test_inner.py"])
    assert "[default0]:1 failed, 1 passed" in output, output
    assert "terminate called" not in output and "SIGABRT" not in output, output
    assert _root_cause(output)[1] == "1", output  # pytest's exit status (a test failed), not an abort
