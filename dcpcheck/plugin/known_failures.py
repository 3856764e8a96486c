"""Known defects that do not mask: a case an implementation marked with a
:class:`~dcpcheck.impls.protocol.KnownFailure` that fails *otherwise* (its
failure's text does not match the defect's ``shows``) is reported as failed,
not as the expected failure: a second bug in that case is news."""

from __future__ import annotations

import re

import pytest

from dcpcheck.compare import HEADLINE
from dcpcheck.impls.protocol import KnownFailure

# The known defects ``dcp.run`` marked the test with (one per run of a case).
DECLARED = pytest.StashKey[list]()


def declare(item: pytest.Item, defect) -> None:
    item.stash.setdefault(DECLARED, []).append(defect)


def unexplained(defects: list, failure: str) -> list[KnownFailure]:
    """The declared defects, when they do not explain ``failure``: each of its
    comparison headlines (:data:`dcpcheck.compare.HEADLINE`) must show one of
    them, or, without headlines, its text must. Empty when they explain it, or
    when a defect is a plain string (which explains any failure)."""
    if not defects or any(not isinstance(defect, KnownFailure) for defect in defects):
        return []
    headlines = [line for line in failure.splitlines() if HEADLINE.search(line)] or [failure]
    shows = [re.compile(defect.shows) for defect in defects]
    if all(any(pattern.search(line) for pattern in shows) for line in headlines):
        return []
    return defects


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outermost: after pytest's xfail handling
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" and report.skipped and hasattr(report, "wasxfail"):  # xfailed; an XPASS has passed
        missed = unexplained(item.stash.get(DECLARED, []), report.longreprtext)
        if missed:
            shows = "; ".join(f"/{defect.shows}/" for defect in missed)
            note = (
                f"not the known defect: {report.wasxfail}\n"
                f"that defect fails a case showing {shows} in each comparison that fails; this failure does not "
                "(another bug, or the defect's failure changed):"
            )
            report.outcome = "failed"
            del report.wasxfail
            report.longrepr = f"{note}\n\n{report.longreprtext}"
    return report
