"""A rank's native stack, beside the Python stack faulthandler writes.

A rank hung inside a kernel launch, a collective or a driver call shows only
its last Python frame; the GB10 TP2+DCP2 bring-up's rank-asymmetric hang in
the SM121 prefill kernel was diagnosed only from each rank's native stack.
Where ``py-spy`` is installed (on PATH or beside this Python; the GPU host
installs it from the wheel carried in ``.whl/``, docs/gpu.md), a hang report
adds ``py-spy dump --native`` of every hung rank; without it, the report is as before.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

PY_SPY_TIMEOUT_S = 30  # one dump of a rank with many threads; a hang report waits this at most per rank


def py_spy() -> str | None:
    """The py-spy executable: on PATH, else beside this interpreter (a venv's bin), else None."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.is_file() else None)


def native_stack(pid: int) -> str | None:
    """``py-spy dump --native`` of ``pid``, one line saying why py-spy gave none, or None without py-spy."""
    executable = py_spy()
    if executable is None:
        return None
    command = [executable, "dump", "--native", "--pid", str(pid)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PY_SPY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"(no native stack: py-spy dump took more than {PY_SPY_TIMEOUT_S} s)"
    if done.returncode != 0 or not done.stdout.strip():
        reason = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return f"(no native stack: py-spy: {reason})"
    return done.stdout.strip()
