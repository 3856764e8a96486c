"""``torchrun -m pytest``: in-process ranks agree on every outcome, only rank
0 reports, and a rank that fails, hangs or leaves a case early fails that
case, with the run header and its cause, at the case timeout at the latest,
and never the next test."""

from __future__ import annotations

import time
import xml.etree.ElementTree as ET

import pytest
import torch

from tests.selftest.support.inner import default_placement, inner_env, run_python_module, write_session

pytestmark = pytest.mark.spawned_only

# On a GPU host a first collective over CUDA tensors, beside other sessions'
# pool starts, has taken over 2 s: a passing case must not meet the timeout.
CASE_TIMEOUT_S = 5 if torch.cuda.is_available() else 2

# Its answers before launch differ between the ranks, or raise on one of them.
DISAGREEING_IMPL = """
import os

from dcpcheck.port.impl import EmbeddedPort


class DisagreeingAnswers(EmbeddedPort):
    name = "disagreeing"

    def unavailable_reason(self, terms):
        if "short_table" in terms.properties and os.environ["RANK"] == "1":
            return "rank 1 alone says this case cannot run"
        return None

    def known_defect(self, terms):
        if "short_table" in terms.properties and os.environ["RANK"] == "1":
            raise ValueError("planted: rank 1's known_defect raises")
        if "lse_near_150" in terms.properties and os.environ["RANK"] == "0":
            raise ValueError("planted: rank 0's known_defect raises")
        return None
"""
IMPL_SPEC = "disagreeing.py:DisagreeingAnswers"

TORCHRUN_TESTS = """
import os
from pathlib import Path

import pytest
from tests.selftest.support.hostile import leave_on_rank, set_variable_then_sleep_on_rank, start_processes, variable_seen
from tests.selftest.support.rank_functions import raise_on_rank, sum_of_ranks

def test_01_passes(dcp):
    dcp.run(sum_of_ranks)

@pytest.mark.parametrize("before_collective", [False, True])
def test_02_rank_one_fails(dcp, before_collective):
    dcp.run(raise_on_rank, bad_rank=1, before_collective=before_collective)

def test_03_stuck_rank(dcp):
    dcp.run(set_variable_then_sleep_on_rank, bad_rank=1)

def test_04_after_a_stuck_rank(dcp):
    assert dcp.run(variable_seen) == [None, None]  # what the stuck case set is put back

def test_05_system_exit(dcp):
    dcp.run(leave_on_rank, bad_rank=1, how="SystemExit")

def test_06_keyboard_interrupt(dcp):
    dcp.run(leave_on_rank, bad_rank=1, how="KeyboardInterrupt", before_collective=False)

def test_07_after_leaving(dcp):
    dcp.run(sum_of_ranks)

def test_07a_starts_processes(dcp):
    dcp.run(start_processes, pid_file=os.path.abspath("case_pids"))

def test_07b_they_are_gone():
    paths = sorted(Path(".").glob("case_pids.*"))
    assert len(paths) == 2, paths
    for path in paths:
        for pid in map(int, path.read_text().split()):
            assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z", pid

@pytest.mark.scenario("short_table")
def test_07c_answers_differ_between_ranks(dcp):
    dcp.run(sum_of_ranks)

@pytest.mark.scenario("lse_near_150")
def test_07d_answer_raises_on_rank_zero(dcp):
    dcp.run(sum_of_ranks)

def test_07e_after_the_answers(dcp):
    dcp.run(sum_of_ranks)

def test_08_os_exit(dcp):
    dcp.run(leave_on_rank, bad_rank=1, how="os._exit")

def test_09_never_runs(dcp):
    dcp.run(sum_of_ranks)
"""


def _outcomes(junit_path) -> dict[str, tuple[str, str, float]]:
    """test name -> (outcome, failure message, seconds), from rank 0's JUnit XML."""
    found = {}
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        failure = case.find("failure")
        outcome = "failed" if failure is not None else "skipped" if case.find("skipped") is not None else "passed"
        message = (failure.get("message", "") + "\n" + (failure.text or "")) if failure is not None else ""
        found[case.get("name")] = (outcome, message, float(case.get("time")))
    return found


@pytest.fixture(scope="module")
def torchrun_session(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("torchrun")
    write_session(tmp_path, {"test_torchrun.py": TORCHRUN_TESTS, "disagreeing.py": DISAGREEING_IMPL})
    launcher = [
        "--nproc-per-node", "2", "--tee", "3",
        "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfs", "--dcp-timeout", str(CASE_TIMEOUT_S),
        "--dcp-impl", IMPL_SPEC,
        "--junitxml", str(tmp_path / "junit.xml"), "test_torchrun.py",
    ]  # fmt: skip
    started = time.perf_counter()
    code, output = run_python_module(tmp_path, "torch.distributed.run", launcher, env=inner_env(), timeout=120)
    assert code is not None, f"the torchrun job did not end within 120 s:\n{output}"
    assert (tmp_path / "junit.xml").exists(), output
    return code, output, _outcomes(tmp_path / "junit.xml"), time.perf_counter() - started


def test_ranks_agree_and_only_rank_zero_reports(torchrun_session):
    code, output, outcomes, _ = torchrun_session
    assert code != 0, output
    assert output.count("7 failed, 7 passed") == 1, output  # only rank 0 printed its summary
    assert outcomes["test_01_passes[W2]"][0] == "passed"
    after, before = outcomes["test_02_rank_one_fails[W2-False]"], outcomes["test_02_rank_one_fails[W2-True]"]
    assert after[0] == before[0] == "failed"
    assert "failing ranks [1]; ranks [0] passed" in after[1]
    assert "[rank 1] ValueError: planted failure on rank 1" in after[1]
    # Rank 1 failed before the collective: rank 0 is stopped PEER_GRACE_S later, not at the timeout.
    assert "failing ranks [1]; ranks [0] did not finish: still running after a peer failed" in before[1]


def test_stuck_rank_fails_at_the_timeout_and_the_next_test_passes(torchrun_session):
    _, output, outcomes, _ = torchrun_session
    outcome, message, seconds = outcomes["test_03_stuck_rank[W2]"]
    assert outcome == "failed", output
    assert f"stage=harness | W=2 | device={default_placement(2)} | impl={IMPL_SPEC} | mode=torchrun | seed=" in message
    assert f"ranks [0, 1] did not finish: timed out after {CASE_TIMEOUT_S} s" in message
    assert "[rank 1] Python stacks at the timeout" in message and "sleep_on_rank" in message
    assert "[rank 0] Python stacks at the timeout" in message and "all_reduce" in message
    assert "its changes of the environment (DCPCHECK_SELFTEST_LEAK set) were put back" in message
    assert seconds < CASE_TIMEOUT_S + 3
    assert outcomes["test_04_after_a_stuck_rank[W2]"][0] == "passed", output


def test_answers_before_launch_are_rank_zeros_on_every_rank(torchrun_session):
    _, output, outcomes, _ = torchrun_session
    # Rank 1 alone would skip, or raise: rank 0 asks, every rank takes its answers.
    assert outcomes["test_07c_answers_differ_between_ranks[W2]"][0] == "passed", output
    outcome, message, seconds = outcomes["test_07d_answer_raises_on_rank_zero[W2]"]
    assert outcome == "failed", output
    assert f"{IMPL_SPEC}.known_defect(terms) raised ValueError: planted: rank 0's known_defect raises" in message
    assert "asked before launch, on rank 0" in message and seconds < CASE_TIMEOUT_S
    assert outcomes["test_07e_after_the_answers[W2]"][0] == "passed", output


def test_rank_leaving_a_case_early_is_reported_with_its_cause(torchrun_session):
    _, output, outcomes, _ = torchrun_session
    for name, raised in (
        ("test_05_system_exit[W2]", "SystemExit: 0"),
        ("test_06_keyboard_interrupt[W2]", "KeyboardInterrupt"),
    ):
        outcome, message, _ = outcomes[name]
        assert outcome == "failed", output
        assert f"[rank 1] {raised}" in message and "left the case early" in message, message
        assert "leave_on_rank" in message  # its own case's traceback, not another test's
    assert outcomes["test_07_after_leaving[W2]"][0] == "passed", output


def test_processes_a_case_starts_are_gone_when_it_ends(torchrun_session):
    _, output, outcomes, _ = torchrun_session
    assert outcomes["test_07a_starts_processes[W2]"][0] == "passed", output
    assert outcomes["test_07b_they_are_gone"][0] == "passed", output


def test_rank_exiting_mid_case_is_named_and_the_session_stops(torchrun_session):
    _, output, outcomes, wall = torchrun_session
    outcome, message, _ = outcomes["test_08_os_exit[W2]"]
    assert outcome == "failed", output
    assert "[rank 1] worker died: called os._exit(7) during the case" in message, message
    assert "the session stops after this test" in message
    assert "test_09_never_runs[W2]" not in outcomes
    assert wall < 60, output
