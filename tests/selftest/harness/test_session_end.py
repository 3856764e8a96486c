"""A session that ends leaves nothing: Ctrl-C during a stuck case ends it at
once, without waiting for the ranks, and leaves no process and no temporary
directory; a session that finishes leaves no pool process, no directory of a
pool that died between cases, and nothing a case started."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from xdist.workermanage import NodeManager

from dcpcheck.ranks.pool import STOP_WAIT_S
from tests.selftest.support.inner import start_inner_pytest, write_session
from tests.selftest.support.processes import alive, start_stuck_session, wait_until, watch_end
from tests.selftest.support.slowdown import Slowdown

pytestmark = pytest.mark.spawned_only

# Ctrl-C during a case must not wait for the stuck ranks (the case timeout) nor
# for their orderly stop (up to STOP_WAIT_S): the pool is killed at once. The
# margin under STOP_WAIT_S is for pytest's own exit on two cores; the bound
# stretches with how slow other tests make the machine meanwhile.
CTRL_C_RETURN_S = STOP_WAIT_S - 2.0
# Under xdist the controller's teardown gives a worker that has not yet exited
# xdist's own EXIT_TIMEOUT before it kills it (xdist/workermanage.py,
# NodeManager.teardown_nodes), then waits up to EXIT_TIMEOUT again for the
# gateway's threads (execnet/multi.py, safe_terminate: termreply.get, then
# workerpool.waitall, each with that timeout): on a busy host a worker still
# taking its Ctrl-C costs up to twice that, which is xdist's wait, not
# dcpcheck's (CI measured 21.7 s once). The case timeout (120 s) stays far
# beyond either bound, and the ranks and the pool's directory must still be
# gone at once after.
XDIST_TEARDOWN_S = 2 * NodeManager.EXIT_TIMEOUT


@pytest.mark.parametrize("xdist", [False, True], ids=["plain", "xdist"])
def test_ctrl_c_during_a_stuck_case_ends_the_session_at_once_and_leaves_nothing(tmp_path, xdist):
    started = time.monotonic()
    proc, ranks, pool_dir = start_stuck_session(tmp_path, ["-n", "1"] if xdist else [])
    with Slowdown() as slow:
        interrupted = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        end = watch_end(proc, interrupted, timeout=100)  # under the case timeout: a session that waits for it fails
    bound = slow.bound(CTRL_C_RETURN_S) + (XDIST_TEARDOWN_S if xdist else 0.0)
    assert end.ended_s is not None and end.ended_s < bound, (
        f"pytest did not end within {bound:.1f} s of Ctrl-C, sent {interrupted - started:.1f} s after it started "
        f"(the machine ran {slow.factor:.1f}x slow): " + end.timeline()
    )
    assert wait_until(lambda: not any(map(alive, ranks)), 5), [p for p in ranks if alive(p)]
    assert wait_until(lambda: not pool_dir.exists(), 5), f"{pool_dir} is left"


# One session, three promises kept when it ends: a pool that died between
# cases leaves no temporary directory, what a case started is gone when the
# case ends, and no pool process outlives the session.
FINISHED_SESSION_TESTS = """
from pathlib import Path

import pytest
from tests.selftest.support.hostile import report_then_exit, start_processes
from tests.selftest.support.rank_functions import sum_of_ranks

@pytest.mark.world_sizes(2)
def test_a_rank_exits_after_its_case(dcp):
    dcp.run(report_then_exit, bad_rank=1)

@pytest.mark.world_sizes(2)
def test_the_next_case_gets_a_fresh_pool(dcp):
    dcp.run(sum_of_ranks)

@pytest.mark.world_sizes(2)
def test_starts_processes(dcp):
    dcp.run(start_processes, pid_file="{pid_file}")

def test_they_are_gone():
    paths = sorted(Path("{pid_file}").parent.glob("{pid_file_name}.*"))
    assert len(paths) == 2, paths
    for path in paths:
        for pid in map(int, path.read_text().split()):
            assert not Path(f"/proc/{{pid}}").exists() or Path(f"/proc/{{pid}}/stat").read_text().split(") ")[1][0] == "Z", pid

def test_one_more_pool(dcp):
    dcp.run(sum_of_ranks)
"""


@pytest.fixture(scope="module")
def finished_session(tmp_path_factory):
    """-> (the inner pytest's pid, its output with a line per passed test, its TMPDIR)."""
    tmp_path = tmp_path_factory.mktemp("finished")
    pid_file = tmp_path / "pids"
    tests = FINISHED_SESSION_TESTS.format(pid_file=pid_file, pid_file_name=pid_file.name)
    write_session(tmp_path, {"test_finished.py": tests})
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = start_inner_pytest(tmp_path, ["-rA", "--world-sizes", "1,2", "--dcp-timeout", "20"], TMPDIR=str(scratch))
    output, _ = proc.communicate(timeout=240)
    return proc.pid, output, scratch


def _passed(output: str, *tests: str) -> None:
    for test in tests:
        assert f"PASSED test_finished.py::{test}" in output, f"{test} did not pass:\n{output}"


def _pool_processes(parent_pid: int) -> list[str]:
    """Command lines of the pool processes started by ``parent_pid``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--parent-pid" in args and args[args.index(b"--parent-pid") + 1] == str(parent_pid).encode():
            found.append(b" ".join(args).decode(errors="replace"))
    return found


def test_no_worker_outlives_a_finished_session(finished_session):
    pid, output, _ = finished_session
    _passed(output, "test_one_more_pool[W1]", "test_one_more_pool[W2]")
    assert _pool_processes(pid) == []


def test_a_session_whose_pool_died_between_cases_leaves_no_temporary_directory(finished_session):
    _, output, scratch = finished_session
    _passed(output, "test_a_rank_exits_after_its_case[W2]", "test_the_next_case_gets_a_fresh_pool[W2]")
    assert not list(scratch.glob("dcpcheck-pool-*")), list(scratch.iterdir())


def test_processes_a_case_starts_are_gone_when_it_ends(finished_session):
    _, output, _ = finished_session
    _passed(output, "test_starts_processes[W2]", "test_they_are_gone")
