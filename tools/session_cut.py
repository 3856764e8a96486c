"""Which cases ``gpu_ci.py --session-timeout`` cut. Loaded in every session
through the ``gpu_ci_plugin`` plugin: each case's start and end are appended to the
file :data:`PROGRESS_ENV` names (by every process that runs or reports it:
an xdist worker and its controller, every torchrun rank), with the wall-clock
time and the process that noted it (which worker ran what when: the
session's timeline); a case started and never ended was running when the
time-out stopped its session."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

PROGRESS_ENV = "DCPCHECK_GPU_CI_PROGRESS"


def _note(event: str, nodeid: str) -> None:
    path = os.environ.get(PROGRESS_ENV)
    if path:
        with open(path, "a") as progress:  # one short write: appends from several processes stay whole lines
            progress.write(json.dumps([event, nodeid, round(time.time(), 2), os.getpid()]) + "\n")


def pytest_runtest_logstart(nodeid, location):
    _note("start", nodeid)


def pytest_runtest_logfinish(nodeid, location):
    _note("end", nodeid)


def cut_cases(progress: Path) -> list[str]:
    """The node ids started and never ended, in the order they started."""
    started, ended = {}, set()
    if progress.exists():
        for line in progress.read_text().splitlines():
            try:
                event, nodeid = json.loads(line)[:2]
            except (ValueError, TypeError):
                continue  # a line the stopped process left half written
            if event == "end":
                ended.add(nodeid)
            else:
                started.setdefault(nodeid, None)
    return [nodeid for nodeid in started if nodeid not in ended]


def cut_row_key(step: str, nodeid: str) -> tuple[str, str, str, str, str]:
    """The summary row (step, stage, W, backend, ranks) of a cut case, from its node id alone."""
    world = next(iter(re.findall(r"[\[-]W(\d+)[-\]]", nodeid)), "-")
    backend = next(iter(re.findall(r"\b(ag_rs|a2a)\b", nodeid)), "-")
    return step, "cut", world, backend, "-"
