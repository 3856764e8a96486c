"""``pytest -n 2 --dist loadgroup`` (the README's test command) runs the
self-tests, which mostly wait (on inner sessions and planted timeouts), on
one xdist worker, and the stage tests, which keep the cores busy, on the
other: the waiting overlaps the compute, and each set of pools starts once.

``tools/gpu_ci.py`` sets ``DCPCHECK_XDIST_SPREAD=1`` for its many workers:
then every test file is a group of its own, handed out in the order of the
command line (it lists the longest first), and each realistic GPU file is
split by W (at W <= 2, where a rank's host-side work is largest, by DeepSeek
model too), so that its parts run side by side (each part still builds its
scenarios once, on one worker; the memory-heavy W = 4 and W = 8 parts stay
one each).

The groups are chosen here, by path, in the scheduler: xdist 3.8's own
``loadgroup`` marks its groups in the legacy ``_nodeid``, which pytest 9.2
no longer reads, so ``xdist_group`` marks are silently ignored
(https://github.com/pytest-dev/pytest-xdist/issues/1386)."""

from __future__ import annotations

import os
import re

import pytest

SELFTEST_PREFIX = "tests/selftest/"
GPU_PREFIX = "tests/gpu/"
SPREAD_ENV = "DCPCHECK_XDIST_SPREAD"


def two_groups(nodeid: str) -> str:
    return "selftest" if nodeid.startswith(SELFTEST_PREFIX) else "stages"


def spread_group(nodeid: str) -> str:
    path = nodeid.split("::")[0]
    if not path.startswith(GPU_PREFIX):
        return path
    world = re.search(r"\[W(\d+)", nodeid)
    if world and int(world.group(1)) >= 4:
        return f"{path} W{world.group(1)}"
    model = re.search(r"-(v4\.\d)[-\]]", nodeid)
    return f"{path} W{world.group(1) if world else ''} {model.group(1) if model else ''}".rstrip()


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadgroup":
        return None  # xdist's own
    from xdist.scheduler import LoadScopeScheduling

    group_of = spread_group if os.environ.get(SPREAD_ENV) == "1" else two_groups

    class PathGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return PathGroups(config, log)
