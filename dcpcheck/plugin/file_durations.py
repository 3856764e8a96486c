"""Each test file's duration, measured: written at session end, read by the
schedulers that hand out the longest files first (``tests/conftest.py`` to
xdist's workers, ``tools/gpu_ci.py`` on its command lines).

The table is ``build/test-durations.json`` under the rootdir (ignored by
git), not pytest's cache: CI and gpu_ci run with ``-p no:cacheprovider``. It holds one table per device and implementation
(``"cpu port"``, ``"cuda dsv41"``, ...), each file's seconds: the sum of its
reports' durations (setup, call and teardown of every case), the time a worker
spends on it. The pytest process writes it, never an xdist worker (the
controller gets every worker's reports) nor a torchrun rank (those run the
files one after another), and only after a session that ran its files whole:
none narrowed by ``-k``, ``-m``, ``--deselect`` or a node id, none stopped
early (``-x``, ``--maxfail``, Ctrl-C). The files it ran replace their entries;
the others stay. Sessions that end at once (gpu_ci's, side by side) merge under
a lock. Without a table (a clean clone) the schedulers keep their own order,
the cold-start default."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from dcpcheck.plugin.session import SESSION

DURATIONS_PATH = Path("build", "test-durations.json")  # under the rootdir


def durations_path(rootdir: Path) -> Path:
    return rootdir / DURATIONS_PATH


def table_key(device_type: str, impl_spec: str) -> str:
    return f"{device_type} {impl_spec}"


def read_durations(path: Path, key: str) -> dict[str, float]:
    """The measured seconds per test file of ``key``'s table; empty without
    one (a missing or unreadable file too: the schedulers then keep their
    default order)."""
    try:
        table = json.loads(path.read_text()).get(key, {})
    except (OSError, ValueError, AttributeError):
        return {}
    if not isinstance(table, dict):
        return {}
    return {file: float(seconds) for file, seconds in table.items() if isinstance(seconds, (int, float))}


def handed_out_order(measured: dict[str, float], default: Sequence[str]) -> tuple[str, ...]:
    """The order files are handed out in: the measured ones longest first, then
    the files of ``default`` (the cold-start order) that were not measured."""
    by_time = sorted(measured, key=lambda file: -measured[file])
    return (*by_time, *(file for file in default if file not in measured))


def session_durations(config) -> dict[str, float]:
    """This session's table (its device and implementation), for the scheduler."""
    state = config.stash.get(SESSION, None)
    if state is None:
        return {}
    return read_durations(durations_path(config.rootpath), table_key(state.device_type, state.impl_spec))


def write_durations(path: Path, key: str, seconds: dict[str, float]) -> None:
    """Merge ``seconds`` into ``key``'s table at ``path``, under a lock beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            tables = json.loads(path.read_text())
        except (OSError, ValueError):
            tables = {}
        if not isinstance(tables, dict):
            tables = {}
        table = tables.get(key) if isinstance(tables.get(key), dict) else {}
        tables[key] = dict(sorted({**table, **{file: round(s, 2) for file, s in seconds.items()}}.items()))
        staged = path.with_name(f"{path.name}.{os.getpid()}")
        staged.write_text(json.dumps(tables, indent=1, sort_keys=True) + "\n")
        os.replace(staged, path)


def ran_whole_files(session, exitstatus) -> bool:
    """Whether every file the session ran ran whole (see the module's docstring)."""
    option = session.config.option
    narrowed = (
        getattr(option, "keyword", "")
        or getattr(option, "markexpr", "")
        or getattr(option, "deselect", None)
        or any("::" in arg for arg in session.config.args)
    )
    stopped = session.shouldstop or session.shouldfail or exitstatus not in (pytest.ExitCode.OK, 1)
    return not narrowed and not stopped


class DurationRecorder:
    """Sums each file's report durations; writes them at session end."""

    def __init__(self, path: Path, key: str):
        self.path, self.key = path, key
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report):
        file = report.nodeid.split("::")[0]
        self.seconds[file] = self.seconds.get(file, 0.0) + report.duration

    def pytest_sessionfinish(self, session, exitstatus):
        if self.seconds and ran_whole_files(session, exitstatus):
            write_durations(self.path, self.key, self.seconds)


@pytest.hookimpl(trylast=True)  # after the session state is made
def pytest_configure(config):
    state = config.stash.get(SESSION, None)
    if state is None or hasattr(config, "workerinput") or state.mode.torchrun_world_size:
        return
    path = durations_path(config.rootpath)
    config.pluginmanager.register(DurationRecorder(path, table_key(state.device_type, state.impl_spec)))
