"""The stage x outcome table at the end of a run, so a run says at a glance
which stages hold; after pytest's own short summary, and with the skips
summed by reason."""

from __future__ import annotations

import pytest

from dcpcheck import triton_interpreter
from dcpcheck.impls.protocol import NOT_ON_PORT_PATH
from dcpcheck.plugin.junit_properties import GPU_PEAK_PREFIX, INTERPRETER_FALLBACK, STAGE
from dcpcheck.plugin.runner import ThreadedCall
from dcpcheck.plugin.session import SESSION
from dcpcheck.ranks.rankfn import describe_exception
from dcpcheck.stages import STAGE_ENV, STAGES

OUTCOMES = ("passed", "failed", "skipped", "xfailed", "xpassed", "error")
COLUMNS = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outermost: after the short test summary
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    yield
    write_stage_table(terminalreporter, config)


def skip_reason_of(report) -> str:
    """A skipped report's reason, without pytest's "Skipped: " prefix."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _description(session) -> tuple[str | None, bool]:
    """-> (the implementation's ``describe()`` as a plain string, or None
    without one; False), or (why asking failed, True): it raised, answered
    something else, or did not return within the case timeout. The run's
    outcome stands either way: what it says of the run is not a check."""
    asked = f"{session.impl_spec}.describe()"

    def ask():
        describe = getattr(session.impl, "describe", None)
        return describe() if callable(describe) else None

    call = ThreadedCall(ask)
    if not call.finished(session.timeout):
        innermost = " ".join(line.strip() for line in call.stack().splitlines()[-2:])
        return f"{asked} did not return within {session.timeout:g} s (--dcp-timeout); stuck at {innermost}", True
    try:
        text = call.result()
    except KeyboardInterrupt:
        raise  # a Ctrl-C stays one
    except BaseException as exc:  # noqa: BLE001 - the implementation's error (a sys.exit() too), named
        return f"{asked} raised {' '.join(describe_exception(exc, of_rank_function=False).split())}", True
    if text is None or isinstance(text, str):
        return (None if text is None else str.__str__(text)), False
    return f"{asked} returned a {type(text).__name__}; accepted: a string or None", True


def write_stage_table(terminalreporter, config) -> None:
    counts: dict = {}
    skip_reasons: dict[str, int] = {}
    off_path: dict = {}  # stage -> expected failures of library functions the implementation never reaches
    gpu_peaks: dict[str, int] = {}
    interpreter_fallbacks: set[str] = set()
    for outcome in OUTCOMES:
        for report in terminalreporter.stats.get(outcome, []):
            listed = getattr(report, "user_properties", ())
            properties = dict(listed)
            interpreter_fallbacks.update(v for k, v in listed if k == INTERPRETER_FALLBACK)  # several a case
            for name, value in properties.items():
                if name.startswith(GPU_PEAK_PREFIX):
                    gpu = name[len(GPU_PEAK_PREFIX) :]
                    gpu_peaks[gpu] = max(gpu_peaks.get(gpu, 0), value)
            stage = properties.get(STAGE)
            if stage is None or (report.when != "call" and outcome == "passed"):
                continue
            if outcome == "skipped":
                reason = skip_reason_of(report)
                skip_reasons[reason] = skip_reasons.get(reason, 0) + 1
            if outcome == "xfailed" and f": {NOT_ON_PORT_PATH}" in getattr(report, "wasxfail", ""):
                off_path[stage] = off_path.get(stage, 0) + 1
                continue
            row = counts.setdefault(stage, {})
            row[outcome] = row.get(outcome, 0) + 1
    if not counts and not off_path:
        return
    terminalreporter.section("dcpcheck stages")
    session = config.stash.get(SESSION, None)
    if session is not None:
        terminalreporter.write_line(
            f"impl={session.impl_spec} device={session.describe_devices()} "
            f"mode={session.mode.name} {STAGE_ENV}={'unset' if session.reached is None else session.reached}"
        )
        terminalreporter.write_line(triton_interpreter.install().header_line(sorted(interpreter_fallbacks)))
        description, failed = _description(session)
        if description is not None:
            # What the implementation runs here (e.g. which kernel stands in for one that cannot run).
            terminalreporter.write_line(description, red=failed)
    terminalreporter.write_line(f"{'stage':<40}" + "".join(f"{c:>9}" for c in COLUMNS))
    for stage in sorted(counts):
        row = counts[stage]
        name = f"{stage} {STAGES.get(stage, '')}"
        terminalreporter.write_line(f"{name:<40}" + "".join(f"{row.get(c, 0):>9}" for c in COLUMNS))
    if off_path:
        per_stage = ", ".join(f"stage {stage}: {count}" for stage, count in sorted(off_path.items()))
        terminalreporter.write_line(
            f"vLLM functions, not on the port's path: {sum(off_path.values())} xfailed ({per_stage}), not counted above"
        )
    if skip_reasons:
        terminalreporter.write_line("skipped, by reason (each test under -rs):")
        for reason, count in sorted(skip_reasons.items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f"{count:>5}  {reason}")
    if gpu_peaks:
        # The largest case per GPU: what a runner must have free to run this selection.
        peaks = ", ".join(f"{gpu} {peak / 2**30:.2f} GiB" for gpu, peak in sorted(gpu_peaks.items()))
        terminalreporter.write_line(f"peak GPU memory reserved by one case (its ranks together): {peaks}")
