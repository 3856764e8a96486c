"""No process outlives what started it: a killed pytest leaves no rank, even
one spinning with the GIL held, nor anything a rank started (in its group, in
a new session, or a daemon), nor the pool's temporary directory; and what a
case starts is gone when the case ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dcpcheck.ranks.pool import STOP_WAIT_S
from dcpcheck.ranks.procstate import process_state_letter
from tests.selftest.inner import inner_env, start_inner_pytest, write_session

pytestmark = pytest.mark.spawned_only

GIL_SPINNING_TESTS = """
from tests.selftest.hostile import spin_holding_the_gil, start_processes

def spin_after_starting_processes(ctx, *, marker, pid_file, stop_rank):
    start_processes(ctx, pid_file=pid_file)
    spin_holding_the_gil(ctx, marker=marker, stop_rank=stop_rank)

def test_spins(dcp, tmp_path_factory):
    dcp.run(spin_after_starting_processes, marker="{marker}", pid_file="{pid_file}", stop_rank={stop_rank})
"""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _wait_until(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.1)
    return predicate()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killed_session_leaves_no_process_even_with_the_gil_held_or_a_rank_stopped(tmp_path, sig):
    # Rank 0 spins with the GIL held, rank 1 is stopped (SIGSTOP): when pytest
    # dies the kernel also sends SIGHUP to the pool's now orphaned process group.
    marker, pid_file = tmp_path / "spinning", tmp_path / "pids"
    tests = GIL_SPINNING_TESTS.format(marker=marker, pid_file=pid_file, stop_rank=1)
    write_session(tmp_path, {"test_spin.py": tests})
    proc = start_inner_pytest(tmp_path, ["--world-sizes", "2", "-k", "W2", "--dcp-timeout", "120"])
    markers = [Path(f"{marker}.{rank}") for rank in range(2)]
    assert _wait_until(lambda: all(m.exists() for m in markers), 120), proc.communicate(timeout=5)[0]
    ranks = [int(m.read_text()) for m in markers]
    started = [int(pid) for rank in range(2) for pid in Path(f"{pid_file}.{rank}").read_text().split()]
    pool_dir = _pool_dir(ranks[0])
    assert all(map(_alive, ranks + started))
    assert _wait_until(lambda: process_state_letter(ranks[1]) == "T", 10)
    os.kill(proc.pid, sig)
    proc.communicate(timeout=30)
    assert _wait_until(lambda: not any(map(_alive, ranks + started)), 10), [p for p in ranks + started if _alive(p)]
    assert _wait_until(lambda: not pool_dir.exists(), 10), f"{pool_dir} is left"


MAIN_THREAD_ENDING_TESTS = """
from tests.selftest.hostile import end_main_thread_after_starting_processes

def test_ends_its_main_thread(dcp):
    dcp.run(end_main_thread_after_starting_processes, marker="{marker}", pid_file="{pid_file}")
"""


def test_killed_session_leaves_nothing_of_a_rank_shown_as_a_zombie_with_its_threads_running(tmp_path):
    # The zygote must kill what hangs below a rank that /proc shows as a
    # zombie: a rank that pytest's death killed (SIGHUP to its orphaned
    # group) is shown so while its other threads end.
    marker, pid_file, scratch = tmp_path / "ended", tmp_path / "pids", tmp_path / "tmp"
    scratch.mkdir()
    write_session(tmp_path, {"test_ends.py": MAIN_THREAD_ENDING_TESTS.format(marker=marker, pid_file=pid_file)})
    proc = start_inner_pytest(tmp_path, ["--world-sizes", "1", "--dcp-timeout", "120"], TMPDIR=str(scratch))
    rank_marker = Path(f"{marker}.0")
    assert _wait_until(rank_marker.exists, 120), proc.communicate(timeout=5)[0]
    rank = int(rank_marker.read_text())
    started = [int(pid) for pid in Path(f"{pid_file}.0").read_text().split()]
    assert _wait_until(lambda: process_state_letter(rank) == "Z", 10)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    try:
        assert _wait_until(lambda: not any(map(_alive, [rank, *started])), 5), [
            p for p in [rank, *started] if _alive(p)
        ]
        assert _wait_until(lambda: not list(scratch.glob("dcpcheck-pool-*")), 5), list(scratch.iterdir())
    finally:
        for pid in filter(_alive, started):  # a failure must not leave them running either
            os.kill(pid, signal.SIGKILL)


def test_a_zygote_started_after_pytest_died_removes_the_pool_directory(tmp_path):
    pool_dir = tmp_path / "dcpcheck-pool-started-late"
    pool_dir.mkdir()
    gone = subprocess.Popen(["true"])  # its pid: a parent that died before the zygote started
    gone.wait()
    zygote = [
        sys.executable, "-m", "dcpcheck.ranks.worker", "--socket", str(pool_dir / "sock"),
        "--store", str(pool_dir / "store"), "--tmpdir", str(pool_dir), "--world-size", "1", "--device", "cpu",
        "--gpus", "0", "--impl", "port", "--collective-timeout", "1", "--parent-pid", str(gone.pid),
    ]  # fmt: skip
    subprocess.run(zygote, env=inner_env(), timeout=60)
    assert not pool_dir.exists(), list(pool_dir.iterdir())


def _start_spinning_session(tmp_path, args: list[str]):
    """An inner session whose one W = 2 case spins with the GIL held (its
    timeout far away) -> (the process, the rank pids, the pool's directory)."""
    marker, pid_file = tmp_path / "spinning", tmp_path / "pids"
    tests = GIL_SPINNING_TESTS.format(marker=marker, pid_file=pid_file, stop_rank=None)
    write_session(tmp_path, {"test_spin.py": tests})
    proc = start_inner_pytest(
        tmp_path, ["--world-sizes", "2", "-k", "W2", "--dcp-timeout", "120", *args], own_group=True
    )
    markers = [Path(f"{marker}.{rank}") for rank in range(2)]
    assert _wait_until(lambda: all(m.exists() for m in markers), 120), proc.communicate(timeout=5)[0]
    ranks = [int(m.read_text()) for m in markers]
    return proc, ranks, _pool_dir(ranks[0])


@pytest.mark.parametrize("xdist", [False, True], ids=["plain", "xdist"])
def test_ctrl_c_during_a_stuck_case_ends_the_session_at_once_and_leaves_nothing(tmp_path, xdist):
    proc, ranks, pool_dir = _start_spinning_session(tmp_path, ["-n", "1"] if xdist else [])
    interrupted = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    output, _ = proc.communicate(timeout=60)
    seconds = time.monotonic() - interrupted
    assert seconds < CTRL_C_RETURN_S, f"pytest took {seconds:.1f} s to return after Ctrl-C:\n{output}"
    assert _wait_until(lambda: not any(map(_alive, ranks)), 5), [p for p in ranks if _alive(p)]
    assert _wait_until(lambda: not pool_dir.exists(), 5), f"{pool_dir} is left"


# execnet alone ends a worker whose controller died 5 s later, or 15 s where SIGINT is ignored.
XDIST_WORKER_END_S = 3.0


def test_sigterm_of_the_xdist_controller_ends_its_workers_ranks(tmp_path):
    proc, ranks, pool_dir = _start_spinning_session(tmp_path, ["-n", "1"])
    killed = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)  # the controller only, as a CI timeout may send it
    proc.communicate(timeout=30)  # until the worker, which holds its output pipe, is gone too
    assert _wait_until(lambda: not any(map(_alive, ranks)), 10), [p for p in ranks if _alive(p)]
    seconds = time.monotonic() - killed
    assert seconds < XDIST_WORKER_END_S, f"the worker and its ranks outlived their controller by {seconds:.1f} s"
    assert _wait_until(lambda: not pool_dir.exists(), 5), f"{pool_dir} is left"


# Ctrl-C during a case must not wait for the stuck ranks (the case timeout) nor
# for their orderly stop (up to STOP_WAIT_S): the pool is killed at once. The
# margin under STOP_WAIT_S is for pytest's own exit on two loaded cores.
CTRL_C_RETURN_S = STOP_WAIT_S - 2.0


def _pool_dir(rank_pid: int) -> Path:
    """The pool's temporary directory: where the rank's stack file is open."""
    for fd in Path(f"/proc/{rank_pid}/fd").iterdir():
        target = Path(os.readlink(fd))
        if target.name.startswith("stacks"):
            return target.parent
    raise AssertionError(f"rank {rank_pid} has no stack file open")


# One session, three promises kept when it ends: a pool that died between
# cases leaves no temporary directory, what a case started is gone when the
# case ends, and no pool process outlives the session.
FINISHED_SESSION_TESTS = """
from pathlib import Path

import pytest
from tests.selftest.hostile import report_then_exit, start_processes
from tests.selftest.rank_functions import sum_of_ranks

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
