"""What the no-orphan self-tests share: an inner session whose case blocks
with the GIL held, and how a test waits for processes and reads their state."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dcpcheck.ranks.procstate import process_state_letter
from tests.selftest.support.inner import start_inner_pytest, write_session

GIL_HOLDING_TESTS = """
from tests.selftest.support.hostile import block_holding_the_gil, start_processes

def block_after_starting_processes(ctx, *, marker, pid_file, stop_rank):
    start_processes(ctx, pid_file=pid_file)
    block_holding_the_gil(ctx, marker=marker, stop_rank=stop_rank)

def test_blocks(dcp, tmp_path_factory):
    dcp.run(block_after_starting_processes, marker="{marker}", pid_file="{pid_file}", stop_rank={stop_rank})
"""


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    return process_state_letter(pid) not in (None, "Z")


def wait_until(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.1)
    return predicate()


def pool_dir_of(rank_pid: int) -> Path:
    """The pool's temporary directory: where the rank's stack file is open."""
    for fd in Path(f"/proc/{rank_pid}/fd").iterdir():
        target = Path(os.readlink(fd))
        if target.name.startswith("stacks"):
            return target.parent
    raise AssertionError(f"rank {rank_pid} has no stack file open")


def start_stuck_session(tmp_path, args: list[str]):
    """An inner session whose one W = 2 case blocks with the GIL held (its
    timeout far away) -> (the process, the rank pids, the pool's directory)."""
    marker, pid_file = tmp_path / "blocked", tmp_path / "pids"
    tests = GIL_HOLDING_TESTS.format(marker=marker, pid_file=pid_file, stop_rank=None)
    write_session(tmp_path, {"test_block.py": tests})
    proc = start_inner_pytest(
        tmp_path, ["--world-sizes", "2", "-k", "W2", "--dcp-timeout", "120", *args], own_group=True
    )
    markers = [Path(f"{marker}.{rank}") for rank in range(2)]
    assert wait_until(lambda: all(m.exists() for m in markers), 120), proc.communicate(timeout=5)[0]
    ranks = [int(m.read_text()) for m in markers]
    return proc, ranks, pool_dir_of(ranks[0])


@dataclass(frozen=True)
class SessionEnd:
    """How a session ended, in seconds since a signal was sent: each line of
    its output when it came, when its process exited, when its output closed
    (the last process holding the pipe, an xdist worker say, was gone)."""

    lines: list[tuple[float, str]]
    exited_s: float | None
    closed_s: float | None

    @property
    def ended_s(self) -> float | None:
        """When both had happened; None if either had not within the timeout."""
        if self.exited_s is None or self.closed_s is None:
            return None
        return max(self.exited_s, self.closed_s)

    def timeline(self) -> str:
        """Where the time went, for a failure message."""
        lines = "".join(f"  +{at:5.1f} s | {line}" for at, line in self.lines)
        return f"its process exited {_at(self.exited_s)}, its output closed {_at(self.closed_s)}; its output:\n{lines}"


def _at(seconds: float | None) -> str:
    return "not within the timeout" if seconds is None else f"at +{seconds:.1f} s"


def watch_end(proc: subprocess.Popen, since: float, timeout: float) -> SessionEnd:
    """Read ``proc``'s text output until it closes and ``proc`` exits (at
    most ``timeout`` s): -> its :class:`SessionEnd`, timed from ``since``
    (``time.monotonic()``). Past the timeout the process is killed."""
    lines: list[tuple[float, str]] = []
    closed: list[float] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.monotonic() - since, line))
        closed.append(time.monotonic() - since)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout)
        exited = time.monotonic() - since
    except subprocess.TimeoutExpired:
        exited = None
        proc.kill()
    reader.join(max(0.0, since + timeout - time.monotonic()))
    return SessionEnd(list(lines), exited, closed[0] if closed else None)
