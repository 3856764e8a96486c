"""A hang report's native stacks (:mod:`dcpcheck.ranks.native_stacks`): ``py-spy dump --native``
of a process blocked in C, where py-spy is installed; nothing without it; one line when py-spy fails."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from dcpcheck.ranks import native_stacks
from dcpcheck.ranks.native_stacks import native_stack, py_spy

# Blocked in C (a select() on a pipe nobody writes): libc's frame is what py-spy --native adds.
BLOCKED_IN_C = "import select, os; r, w = os.pipe(); print('ready', flush=True); select.select([r], [], [])"


def test_without_py_spy_the_report_is_unchanged(monkeypatch):
    monkeypatch.setattr(native_stacks, "py_spy", lambda: None)
    assert native_stack(1) is None


def test_a_failing_py_spy_is_one_line(monkeypatch):
    monkeypatch.setattr(native_stacks, "py_spy", lambda: "/bin/false")
    assert native_stack(1) == "(no native stack: py-spy: exit 1)"


@pytest.mark.skipif(py_spy() is None, reason="py-spy is not installed (pip install py-spy, or the wheel in .whl/)")
def test_native_stack_of_a_process_blocked_in_c():
    blocked = subprocess.Popen([sys.executable, "-c", BLOCKED_IN_C], stdout=subprocess.PIPE, text=True)
    try:
        assert blocked.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        stack = native_stack(blocked.pid)
        if stack.startswith("(no native stack: py-spy:") and "ermission" in stack:
            pytest.skip(f"this host does not let py-spy attach: {stack}")
        assert "(libc" in stack, stack  # a native frame: without --native only <module> shows
    finally:
        blocked.kill()
        blocked.wait()
