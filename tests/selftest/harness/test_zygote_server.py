"""Pools are forked from one zygote server per session (``dcpcheck/ranks/zygote_server.py``):
a zygote runs as a spawned one would, a fresh pool costs no new torch import,
a server that dies ends its pools and is replaced, and one that stops answering
fails the case that waited on it, and is killed. The self-tests' inner sessions
are forked from one too: ``python -m`` as started in their directory, their
exit code, a run past its timeout killed."""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import pytest

from dcpcheck.ranks.procstate import parent_pid
from dcpcheck.ranks.zygote_server import ServerKind, ZygoteServer, ZygoteServerGone
from tests.selftest.support.hostile import kill_the_zygote_server
from tests.selftest.support.inner import run_inner_pytest, run_python_module, warm_server, write_session
from tests.selftest.support.processes import alive, wait_until
from tests.selftest.support.rank_functions import kill_rank, sum_of_ranks


def where_forked(ctx) -> dict:
    """What this rank's zygote was started with, and what started it."""
    zygote = os.getppid()
    server = parent_pid(zygote)
    return {
        "zygote": zygote,
        "server": server,
        "server command": Path(f"/proc/{server}/cmdline").read_bytes().replace(b"\0", b" ").decode(),
        "argv0": sys.argv[0],
        "cwd": os.getcwd(),
        "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
        "process group": os.getpgid(0) == zygote,
    }


@pytest.mark.spawned_only
@pytest.mark.world_sizes(1)
def test_a_pool_of_one_rank_starts_before_the_server_is_killed(dcp):
    assert dcp.run(sum_of_ranks) == [1.0]


@pytest.mark.spawned_only
@pytest.mark.world_sizes(2)
def test_a_fresh_pool_is_forked_from_the_same_server_and_runs_as_a_spawned_zygote(dcp):
    first = dcp.run(where_forked)[0]
    with pytest.raises(pytest.fail.Exception):
        dcp.run(kill_rank, bad_rank=1, timeout=5)  # its pool is dead: the next case gets a fresh one
    second = dcp.run(where_forked)[0]
    assert second["zygote"] != first["zygote"], "the pool was not replaced"
    assert second["server"] == first["server"], f"a new server for a fresh pool: {first} then {second}"
    assert "dcpcheck.ranks.zygote_server" in second["server command"], second
    assert second["argv0"].endswith(os.path.join("dcpcheck", "ranks", "worker.py")), second
    assert second["cwd"] == os.getcwd(), second
    assert "test_a_fresh_pool_is_forked_from_the_same_server" in second["test"], second  # this test's, not the server's
    assert second["process group"], "the zygote does not lead its pool's process group"


@pytest.mark.spawned_only
@pytest.mark.world_sizes(2)
def test_a_killed_server_ends_its_pool_and_the_next_case_gets_a_new_one(dcp):
    server = dcp.run(where_forked)[0]["server"]
    with pytest.raises(pytest.fail.Exception) as failure:
        dcp.run(kill_the_zygote_server, timeout=20)
    message = str(failure.value)
    assert "timed out" not in message, f"the pool outlived its server until the case timed out: {message}"
    assert f"the zygote server (pid {server}) ended, and every pool it forked with it" in message, message
    assert "killed by signal SIGKILL (9)" in message, message
    assert dcp.run(sum_of_ranks) == [3.0, 3.0]
    assert dcp.run(where_forked)[0]["server"] != server


@pytest.mark.spawned_only
@pytest.mark.world_sizes(1)
def test_a_pool_the_killed_server_forked_for_another_world_size_is_replaced_too(dcp):
    assert dcp.run(sum_of_ranks) == [1.0]


def _server(tmp_path, module: str, source: str, startup_timeout: float = 60.0) -> str:
    (tmp_path / f"{module}.py").write_text(source)
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    with pytest.raises(ZygoteServerGone) as gone:
        ZygoteServer(environ, ServerKind((module,), None, "cpu"), startup_timeout, answer_timeout=60.0)
    return str(gone.value)


def test_a_server_failing_while_it_starts_says_why(tmp_path):
    message = _server(tmp_path, "planted_import_error", "raise ImportError('planted: no torch today')")
    assert "the zygote server ended while it started, after" in message, message
    assert "exited with code 1" in message and "ImportError: planted: no torch today" in message, message


def test_a_server_stuck_while_it_starts_is_ended_at_the_startup_timeout(tmp_path):
    message = _server(tmp_path, "planted_hang", "import time\ntime.sleep(600)", startup_timeout=1.0)
    # What /proc shows it doing: still importing, or in the planted sleep.
    assert re.search(
        r"the zygote server \(pid \d+\) is .*: it did not start within --dcp-startup-timeout 1 s", message
    ), message


STOPPED_SERVER_TESTS = """
import pytest
from tests.selftest.support.hostile import stop_the_zygote_server
from tests.selftest.support.rank_functions import sum_of_ranks

pytestmark = pytest.mark.world_sizes(1)

def test_stops_the_server(dcp):
    dcp.run(stop_the_zygote_server, marker="{marker}")

def test_waits_on_the_stopped_server(dcp):
    dcp.run(sum_of_ranks)

def test_runs_on_a_new_server(dcp):
    dcp.run(sum_of_ranks)
"""
ANSWER_TIMEOUT_S = 3  # the inner session's --dcp-timeout: how long the server may take to answer


@pytest.mark.spawned_only
def test_a_stopped_server_fails_the_case_that_waits_on_it_naming_it_and_leaves_nothing(tmp_path):
    marker, scratch = tmp_path / "server", tmp_path / "tmp"
    scratch.mkdir()
    write_session(tmp_path, {"test_stopped.py": STOPPED_SERVER_TESTS.format(marker=marker)})
    args = ["-rf", "--dcp-timeout", str(ANSWER_TIMEOUT_S)]
    try:
        code, output = run_inner_pytest(tmp_path, args, timeout=150, TMPDIR=str(scratch))
    finally:
        if marker.exists() and alive(int(marker.read_text())):  # a hung session must not leave it stopped
            os.kill(int(marker.read_text()), signal.SIGKILL)
    server = int(marker.read_text())
    assert code == 1 and "1 failed, 2 passed" in output, output
    assert "FAILED test_stopped.py::test_waits_on_the_stopped_server[W1]" in output, output
    assert f"the zygote server (pid {server}) is stopped (SIGSTOP or SIGTSTP)" in output, output
    assert f"within {ANSWER_TIMEOUT_S} s" in output, output
    assert wait_until(lambda: not alive(server), 5), f"the stopped server {server} is left"
    assert wait_until(lambda: not list(scratch.glob("dcpcheck-pool-*")), 5), list(scratch.iterdir())


PLANTED_MODULE = """
import os, sys, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "first on sys.path", sys.path[0], "group", os.getpgid(0) == os.getpid())
print("variable", os.environ.get("PLANTED_VARIABLE"), "parent", os.getppid(), file=sys.stderr)
if sys.argv[1] == "hang":
    time.sleep(600)
sys.exit(int(sys.argv[1]))
"""


def test_a_module_run_is_forked_as_python_m_from_its_directory_and_killed_past_its_timeout(tmp_path):
    (tmp_path / "planted_run.py").write_text(PLANTED_MODULE)
    env = {**os.environ, "PLANTED_VARIABLE": "set"}
    code, output = run_python_module(tmp_path, "planted_run", ["3"], env=env, timeout=60)
    server = warm_server().process.pid
    assert code == 3, output
    assert f"argv ['3'] cwd {tmp_path} first on sys.path {tmp_path} group True" in output, output
    assert f"variable set parent {server}" in output, output
    code, output = run_python_module(tmp_path, "planted_run", ["hang"], env=env, timeout=1)
    assert code is None, output
    assert warm_server().process.pid == server, "the server did not outlive the killed run"
    assert not list(tmp_path.glob(".warm-python-*")), list(tmp_path.iterdir())
