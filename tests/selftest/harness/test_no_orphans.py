"""No process outlives what started it: a killed pytest (or a killed xdist
controller) leaves no rank, even one blocked with the GIL held, nor anything
a rank started (in its group, in a new session, or a daemon), nor the pool's
temporary directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dcpcheck.ranks.procstate import parent_pid, process_state_letter
from tests.selftest.support.inner import inner_env, start_inner_pytest, write_session
from tests.selftest.support.processes import GIL_HOLDING_TESTS, alive, pool_dir_of, start_stuck_session, wait_until
from tests.selftest.support.slowdown import Slowdown

pytestmark = pytest.mark.spawned_only


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killed_session_leaves_no_process_even_with_the_gil_held_or_a_rank_stopped(tmp_path, sig):
    # Rank 0 blocks with the GIL held, rank 1 is stopped (SIGSTOP): when pytest
    # dies the kernel also sends SIGHUP to the pool's now orphaned process group.
    marker, pid_file = tmp_path / "blocked", tmp_path / "pids"
    tests = GIL_HOLDING_TESTS.format(marker=marker, pid_file=pid_file, stop_rank=1)
    write_session(tmp_path, {"test_block.py": tests})
    proc = start_inner_pytest(tmp_path, ["--world-sizes", "2", "-k", "W2", "--dcp-timeout", "120"])
    markers = [Path(f"{marker}.{rank}") for rank in range(2)]
    assert wait_until(lambda: all(m.exists() for m in markers), 120), proc.communicate(timeout=5)[0]
    ranks = [int(m.read_text()) for m in markers]
    started = [int(pid) for rank in range(2) for pid in Path(f"{pid_file}.{rank}").read_text().split()]
    pool_dir = pool_dir_of(ranks[0])
    zygote_server = parent_pid(parent_pid(ranks[0]))
    assert all(map(alive, ranks + started + [zygote_server]))
    assert wait_until(lambda: process_state_letter(ranks[1]) == "T", 10)
    os.kill(proc.pid, sig)
    proc.communicate(timeout=30)
    left = ranks + started + [zygote_server]
    assert wait_until(lambda: not any(map(alive, left)), 10), [p for p in left if alive(p)]
    assert wait_until(lambda: not pool_dir.exists(), 10), f"{pool_dir} is left"


MAIN_THREAD_ENDING_TESTS = """
from tests.selftest.support.hostile import end_main_thread_after_starting_processes

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
    assert wait_until(rank_marker.exists, 120), proc.communicate(timeout=5)[0]
    rank = int(rank_marker.read_text())
    started = [int(pid) for pid in Path(f"{pid_file}.0").read_text().split()]
    assert wait_until(lambda: process_state_letter(rank) == "Z", 10)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    try:
        assert wait_until(lambda: not any(map(alive, [rank, *started])), 5), [p for p in [rank, *started] if alive(p)]
        assert wait_until(lambda: not list(scratch.glob("dcpcheck-pool-*")), 5), list(scratch.iterdir())
    finally:
        for pid in filter(alive, started):  # a failure must not leave them running either
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


# execnet alone ends a worker whose controller died 5 s later, or 15 s where SIGINT is ignored.
XDIST_WORKER_END_S = 3.0


def test_sigterm_of_the_xdist_controller_ends_its_workers_ranks(tmp_path):
    proc, ranks, pool_dir = start_stuck_session(tmp_path, ["-n", "1"])
    with Slowdown() as slow:
        killed = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)  # the controller only, as a CI timeout may send it
        proc.communicate(timeout=30)  # until the worker, which holds its output pipe, is gone too
        assert wait_until(lambda: not any(map(alive, ranks)), 10), [p for p in ranks if alive(p)]
        seconds = time.monotonic() - killed
    assert seconds < slow.bound(XDIST_WORKER_END_S), (
        f"the worker and its ranks outlived their controller by {seconds:.1f} s (the machine ran {slow.factor:.1f}x slow)"
    )
    assert wait_until(lambda: not pool_dir.exists(), 5), f"{pool_dir} is left"
