"""Known defects that do not mask: a case an implementation marked with a
:class:`~dcpcheck.impls.protocol.KnownFailure` that fails *otherwise* (its
failure's text does not match the defect's ``shows``) is reported as failed,
not as the expected failure: a second bug in that case is news. So is one
whose case, run again with the defect's cause neutralised (its ``cures``,
:meth:`dcpcheck.plugin.runner.DcpRunner.run`), still fails."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dcpcheck.compare import HEADLINE
from dcpcheck.impls.protocol import KnownFailure
from dcpcheck.plugin.session import dcp_session

# The known defects ``dcp.run`` marked the test with (one per run of a case).
DECLARED = pytest.StashKey[list]()
# Set on a test whose case, its known defects cured, still failed.
SECOND_BUG = pytest.StashKey[bool]()
BEHIND_KNOWN_DEFECT = "a second bug behind the known defect"

# Seconds matching the declared defects' shows against a failure may take.
# Python's re has no timeout and its matcher holds the GIL until it returns,
# so neither a thread nor a signal can stop a pattern that backtracks without
# bound ((a+)+$ against a run of a's takes years): the match runs in a child
# interpreter, killed past this bound. No pattern is refused up front, since
# which ones backtrack depends on the text, and no text is cut, since a short
# one suffices to hang.
MATCH_TIMEOUT_S = 10.0
MATCHER = (
    "import json, re, sys\n"
    "shows, lines = json.load(sys.stdin)\n"
    "patterns = [re.compile(pattern) for pattern in shows]\n"
    "print(json.dumps(all(any(pattern.search(line) for pattern in patterns) for line in lines)))\n"
)


class UnboundedMatch(Exception):
    """Matching a defect's shows against a failure did not end within the bound."""


def declare(item: pytest.Item, defect) -> None:
    item.stash.setdefault(DECLARED, []).append(defect)


def behind_known_defect(item: pytest.Item) -> None:
    """The case failed again with its known defects cured: its failure is not (only) theirs."""
    item.stash[SECOND_BUG] = True


def _each_line_shows_one(shows: list[str], lines: list[str]) -> bool:
    try:
        matched = subprocess.run(
            [sys.executable, "-I", "-S", "-c", MATCHER],
            input=json.dumps([shows, lines]),
            capture_output=True,
            text=True,
            timeout=MATCH_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise UnboundedMatch(f"did not end within {MATCH_TIMEOUT_S:g} s") from None
    if matched.returncode != 0:
        raise UnboundedMatch(f"failed: {(matched.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(matched.stdout)


def unexplained(defects: list, failure: str) -> list[KnownFailure]:
    """The declared defects, when they do not explain ``failure``: each of its
    comparison headlines (:data:`dcpcheck.compare.HEADLINE`) must show one of
    them, or, without headlines, its text must. Empty when they explain it, or
    when a defect is a plain string (which explains any failure). Raises
    :class:`UnboundedMatch` when matching does not end in time."""
    if not defects or any(not isinstance(defect, KnownFailure) for defect in defects):
        return []
    headlines = [line for line in failure.splitlines() if HEADLINE.search(line)] or [failure]
    return [] if _each_line_shows_one([defect.shows for defect in defects], headlines) else defects


def _not_shown(item, report) -> str | None:
    """Why the failure in ``report`` is not the known defect it was marked
    with (the first lines of the report then), or None when it is."""
    if item.stash.get(SECOND_BUG, False):
        return f"not the known defect: {report.wasxfail}"
    defects = item.stash.get(DECLARED, [])
    try:
        missed = unexplained(defects, report.longreprtext)
    except UnboundedMatch as exc:
        shows = ", ".join(f"/{defect.shows}/" for defect in defects)
        return (
            f"not the known defect: {report.wasxfail}\n"
            f"{dcp_session(item.config).impl_spec}.known_defect(terms) answered shows {shows}; matching it against "
            f"this failure {exc}: a pattern that backtracks without bound (nested quantifiers, as in (a+)+) cannot "
            "tell; the failure:"
        )
    if not missed:
        return None
    shows = "; ".join(f"/{defect.shows}/" for defect in missed)
    return (
        f"not the known defect: {report.wasxfail}\n"
        f"that defect fails a case showing {shows} in each comparison that fails; this failure does not "
        "(another bug, or the defect's failure changed):"
    )


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outermost: after pytest's xfail handling
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" and report.skipped and hasattr(report, "wasxfail"):  # xfailed; an XPASS has passed
        note = _not_shown(item, report)
        if note:
            report.outcome = "failed"
            del report.wasxfail
            report.longrepr = f"{note}\n\n{report.longreprtext}"
    return report
