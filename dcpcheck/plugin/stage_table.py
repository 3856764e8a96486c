"""The stage x outcome table at the end of a run, so a run says at a glance
which stages hold."""

from __future__ import annotations

from dcpcheck.plugin.session import SESSION
from dcpcheck.stages import STAGE_ENV, STAGES

OUTCOMES = ("passed", "failed", "skipped", "xfailed", "xpassed", "error")
COLUMNS = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    counts: dict = {}
    for outcome in OUTCOMES:
        for report in terminalreporter.stats.get(outcome, []):
            stage = dict(getattr(report, "user_properties", ())).get("dcp_stage")
            if stage is None or (report.when != "call" and outcome == "passed"):
                continue
            row = counts.setdefault(stage, {})
            row[outcome] = row.get(outcome, 0) + 1
    if not counts:
        return
    terminalreporter.section("dcpcheck stages")
    session = config.stash.get(SESSION, None)
    if session is not None:
        terminalreporter.write_line(
            f"impl={session.impl_spec} device={session.device_type}/{session.backend} "
            f"mode={session.mode} {STAGE_ENV}={'unset' if session.reached is None else session.reached}"
        )
        describe = getattr(session.impl, "describe", None)
        if callable(describe):
            # What the implementation runs here (e.g. which kernel stands in for one that cannot run).
            terminalreporter.write_line(describe())
    terminalreporter.write_line(f"{'stage':<40}" + "".join(f"{c:>9}" for c in COLUMNS))
    for stage in sorted(counts):
        row = counts[stage]
        name = f"{stage} {STAGES.get(stage, '')}"
        terminalreporter.write_line(f"{name:<40}" + "".join(f"{row.get(c, 0):>9}" for c in COLUMNS))
