"""The stage table: expected failures of library functions the port never
reaches on a line of their own, and the skips summed by reason."""

from __future__ import annotations

from types import SimpleNamespace

from dcpcheck.impls.protocol import NOT_ON_PORT_PATH
from dcpcheck.plugin.stage_table import write_stage_table


class Reporter:
    def __init__(self, stats):
        self.stats, self.lines = stats, []

    def section(self, title):
        self.lines.append(f"== {title} ==")

    def write_line(self, line):
        self.lines.append(line)


def report(stage, **fields):
    return SimpleNamespace(user_properties=[("dcp_stage", stage)], when="call", **fields)


def test_off_path_expected_failures_and_skip_reasons_are_told_apart():
    stats = {
        "passed": [report(1)],
        "xfailed": [
            report(1, wasxfail=f"known defect of dsv41: {NOT_ON_PORT_PATH}: short table"),
            report(3, wasxfail=f"known defect of dsv41: {NOT_ON_PORT_PATH}: W=1 ag_rs"),
            report(3, wasxfail="known defect of dsv41: the port's own"),
        ],
        "skipped": [
            report(3, longrepr=("file.py", 1, "Skipped: W=8 is not selected")),
            report(3, longrepr=("file.py", 2, "Skipped: W=8 is not selected")),
            report(9, longrepr=("file.py", 3, "Skipped: lacks capability prefill_gather")),
        ],
    }
    reporter = Reporter(stats)
    write_stage_table(reporter, SimpleNamespace(stash={}))
    text = "\n".join(reporter.lines)
    rows = {line.split()[0]: line.split()[-6:] for line in reporter.lines if line[:1].isdigit() and "  " in line}
    assert rows["3"] == ["0", "0", "0", "2", "1", "0"], text  # one own xfail; the off-path one is not counted
    assert "vLLM functions, not on the port's path: 2 xfailed (stage 1: 1, stage 3: 1), not counted above" in text
    assert "    2  W=8 is not selected" in text and "    1  lacks capability prefill_gather" in text, text
