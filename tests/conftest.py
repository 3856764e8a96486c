"""``pytest -n 2 --dist loadgroup`` (the README's test command) runs the
self-tests, which mostly wait (on inner sessions and planted timeouts), on
one xdist worker, and the stage tests, which keep the cores busy, on the
other: the waiting overlaps the compute, and each set of pools starts once.

The groups are chosen here, by path, in the scheduler: xdist 3.8's own
``loadgroup`` marks its groups in the legacy ``_nodeid``, which pytest 9.2
no longer reads, so ``xdist_group`` marks are silently ignored
(https://github.com/pytest-dev/pytest-xdist/issues/1386)."""

from __future__ import annotations

import pytest

SELFTEST_PREFIX = "tests/selftest/"


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadgroup":
        return None  # xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class SelftestsBesideStages(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "selftest" if nodeid.startswith(SELFTEST_PREFIX) else "stages"

    return SelftestsBesideStages(config, log)
