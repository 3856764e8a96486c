"""Labels what coverage.py records with the test that ran it.

``tools/diff_coverage.py`` measures which lines of a port's diff the suite
runs, per stage folder. The ranks are long-lived processes shared by many
tests, so each records under the node id of the case it runs (the worker
calls :func:`switch`), and the pytest process under the test it is in (this
module is also a pytest plugin: ``-p dcpcheck.coverage_context``). Nothing
happens unless coverage.py is measuring the process.
"""

from __future__ import annotations

import sys


def switch(label: str) -> None:
    """Record what runs from now on under ``label`` (no-op without coverage)."""
    coverage = sys.modules.get("coverage")  # measured processes imported it already
    if coverage is None:
        return
    current = coverage.Coverage.current()
    if current is not None:
        current.switch_context(label)


def pytest_runtest_logstart(nodeid: str, location) -> None:
    switch(nodeid)
