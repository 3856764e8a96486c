"""Inner sessions started ahead. The slow inner sessions of the self-tests
(an interpreter start, pools, planted timeouts) mostly wait: each is started
when the first self-test runs, side by side with the others and with the
self-tests this process runs itself, and the module fixture that registered
it collects its output when its tests come.

A fixture registers its start with :func:`starts_ahead`; only those that a
selected test uses are started ahead (a test run alone starts its own when
it needs it), and what was started but never collected is killed at the end
of the session (tests/selftest/conftest.py)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest


@dataclass
class Ended:
    code: int
    stdout: str
    stderr: str  # empty where stderr went to stdout
    seconds: float  # from its start to its end


@dataclass
class Running:
    """An inner session's process; ``timeout`` counts from its start."""

    proc: subprocess.Popen
    timeout: float
    where: Path | None = None  # its working directory, where that matters to its checks
    started: float = field(default_factory=time.perf_counter)

    def wait(self) -> Ended:
        remaining = max(0.0, self.timeout - (time.perf_counter() - self.started))
        try:
            stdout, stderr = self.proc.communicate(timeout=remaining)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # a hung inner session must not outlive its test
            stdout, stderr = self.proc.communicate()
            raise AssertionError(
                f"inner session did not end within {self.timeout:g} s:\n{stdout}{stderr or ''}"
            ) from None
        return Ended(self.proc.returncode, stdout, stderr or "", time.perf_counter() - self.started)


Start = Callable[[pytest.TempPathFactory], Running]
_STARTS: dict[str, Start] = {}
_running: dict[str, Running] = {}


def starts_ahead(fixture_name: str) -> Callable[[Start], Start]:
    """Register ``start(tmp_path_factory) -> Running``: the inner session
    whose output the fixture ``fixture_name`` collects with :func:`running`."""

    def register(start: Start) -> Start:
        _STARTS[fixture_name] = start
        return start

    return register


def start_ahead(items: list[pytest.Item], tmp_path_factory: pytest.TempPathFactory) -> None:
    """Start the registered sessions that a test in ``items`` uses (one not skipped)."""
    used = {name for item in items if not item.get_closest_marker("skip") for name in item.fixturenames}
    for name, start in _STARTS.items():
        if name in used and name not in _running:
            _running[name] = start(tmp_path_factory)


def running(fixture_name: str, tmp_path_factory: pytest.TempPathFactory) -> Running:
    """The session registered for ``fixture_name``: started ahead, else now."""
    if fixture_name not in _running:
        _running[fixture_name] = _STARTS[fixture_name](tmp_path_factory)
    return _running.pop(fixture_name)


def kill_uncollected() -> None:
    """End the sessions started ahead whose tests never ran (``-x``, Ctrl-C)."""
    while _running:
        _, session = _running.popitem()
        session.proc.kill()
        session.proc.communicate()
