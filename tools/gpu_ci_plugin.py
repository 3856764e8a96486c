"""The pytest plugin every session of ``tools/gpu_ci.py`` loads (``-p gpu_ci_plugin``,
this folder on ``PYTHONPATH``). pytest writes an XPASS to JUnit as a plain
passed testcase, without its reason: this plugin records both there. It also
brings ``tools/session_cut.py``'s hooks, which note each case's start and end
for ``--session-timeout``. It imports nothing of dcpcheck, so that the suite's
conftest still loads dcpcheck's plugin itself, its asserts rewritten."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from session_cut import pytest_runtest_logfinish, pytest_runtest_logstart  # noqa: F401  (hooks)

PLUGIN = "gpu_ci_plugin"  # this module, as ``-p`` names it
XPASS_NODEID = "gpu_ci_xpass_nodeid"
XPASS_REASON = "gpu_ci_xpass_reason"


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outside pytest's skipping plugin, which marks the XPASS
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" and report.passed and hasattr(report, "wasxfail"):
        # The teardown report copies the item's properties; JUnit writes those.
        item.user_properties += [(XPASS_NODEID, item.nodeid), (XPASS_REASON, report.wasxfail)]
    return report


def with_plugin_path(env: dict) -> dict:
    """``env`` with this folder on PYTHONPATH, so that ``-p gpu_ci_plugin`` finds this module."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))}
