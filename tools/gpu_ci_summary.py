"""The GPU CI's summary (``tools/gpu_ci.py``) in markdown: the rows, the
sessions, where each step's time went, per W for the steps that ask, the
slowest test modules, the expected failures and XPASSes, dsv41's sparse-MLA
kernels; and the run's closing line per XPASS."""

from __future__ import annotations

from pathlib import Path

from gpu_ci_junit import Phases, Row
from gpu_ci_launch import SessionRun
from gpu_ci_sessions import PER_WORLD_STEPS

from dcpcheck.impls.dsv41.kernels import cross_check
from dcpcheck.plugin import junit_properties as prop

SLOWEST_SHOWN = 8  # test modules listed by their cases' seconds
XPASS_NOTE = "XPASS (a known defect did not show: fixed, or its case missed it)"


def phase_totals(phases: dict[str, Phases]) -> str:
    """One line: every step's phases summed (the CI's timing budget, read at a glance)."""
    totals = {phase: sum(p.totals[phase] for p in phases.values()) for phase in prop.PHASES}
    seconds = sum(p.seconds for p in phases.values())
    checking = seconds - totals["pool_start_s"] - totals["compile_s"] - totals["gpu_ledger_wait_s"]
    return (
        f"phases, summed over every case: cases {seconds:.1f} s = pool start {totals['pool_start_s']:.1f} "
        f"(CUDA init {totals['cuda_init_s']:.1f}, group init {totals['group_init_s']:.1f}) "
        f"+ compile {totals['compile_s']:.1f} + GPU ledger wait {totals['gpu_ledger_wait_s']:.1f} "
        f"+ checking {checking:.1f}; "
        f"pool starts tried again for GPU memory: {totals['out_of_memory_retries']:.0f}; "
        f"idle pools ended for GPU memory: {totals['idle_pools_ended']:.0f}"
    )


def per_world_lines(rows: dict[tuple, Row], phases: dict[str, Phases]) -> list[str]:
    """Markdown: for each of PER_WORLD_STEPS that ran, its cases' seconds and peak GPU memory per W."""
    lines = []
    for step in (s for s in PER_WORLD_STEPS if s in phases):
        lines += ["", f"| {step}: W | cases | case s | peak GPU GiB |", "|---|---:|---:|---:|"]
        for world in sorted(phases[step].worlds, key=lambda w: int(w) if w.isdigit() else 0):
            ran = [row for key, row in rows.items() if key[0] == step and key[2] == world]
            peak = max((row.gpu_peak_bytes for row in ran), default=0)
            lines.append(
                f"| {world} | {sum(row.cases for row in ran)} | {phases[step].worlds[world]:.1f} "
                f"| {f'{peak / 2**30:.2f}' if peak else '-'} |"
            )
    return lines


def render(
    rows: dict[tuple, Row],
    phases: dict[str, Phases],
    runs: list[SessionRun],
    order: list[str],
    xfails: list[tuple[str, str, str]],
    xpasses: list[tuple[str, str, str]],
) -> str:
    """Markdown: one line per (step, stage, W, backend), then the sessions, then where each step's time went,
    then every expected failure with its reason, then every XPASS with its reason."""
    lines = [
        "| step | stage | W | backend | ranks | cases | passed | failed | xfailed | xpassed | skipped "
        "| worst err/tol | max abs err | peak GPU GiB |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def key_order(key):
        step, stage, world, backend, _ = key
        return (order.index(step) if step in order else 99, stage, int(world) if world.isdigit() else 0, backend)

    for key in sorted(rows, key=key_order):
        row = rows[key]
        ratio = f"{max(row.worst_ratios):.3g}" if row.worst_ratios else "-"
        abs_err = f"{max(row.max_abs_errs):.3g}" if row.max_abs_errs else "-"
        peak = f"{row.gpu_peak_bytes / 2**30:.2f}" if row.gpu_peak_bytes else "-"
        lines.append(
            f"| {' | '.join(key)} | {row.cases} | {row.passed} | {row.failed} | {row.xfailed} | {row.xpassed} "
            f"| {row.skipped} | {ratio} | {abs_err} | {peak} |"
        )
    # A session's case seconds over its workers is the least wall time its cases need: near its wall time, the
    # session waits on its workers (more would end it sooner); far below, on the host (cores, GPU, start-up).
    lines += [
        "",
        "| session | wave | exit | wall s | workers | case s | case s per worker |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        case_s = sum(phases[step].seconds for step in run.steps if step in phases)
        lines.append(
            f"| {run.name} | {run.wave} | {run.code} | {run.seconds:.1f} | {run.workers} | {case_s:.1f} "
            f"| {case_s / run.workers:.1f} |"
        )
    lines += [
        "",
        "Per step, summed over its cases (concurrent workers: sums exceed wall time). Pool start holds CUDA init "
        "and group init (the slowest rank of each start); ledger wait: waiting for GPU memory declared by running "
        "cases (dcpcheck/ranks/gpu_ledger.py); checking = case seconds - pool start - compile - ledger wait; "
        "OOM retries: pool starts that ran out of GPU memory and were tried again; pools ended: idle pools a "
        "worker ended before a case, its GPU short of free memory or a case waiting for it.",
        "",
        "| step | cases | case s | pool start s | CUDA init s | group init s | compile s | ledger wait s "
        "| checking s | OOM retries | pools ended |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for step in sorted(phases, key=lambda s: order.index(s) if s in order else 99):
        p = phases[step]
        t = p.totals
        lines.append(
            f"| {step} | {p.cases} | {p.seconds:.1f} | {t['pool_start_s']:.1f} | {t['cuda_init_s']:.1f} "
            f"| {t['group_init_s']:.1f} | {t['compile_s']:.1f} | {t['gpu_ledger_wait_s']:.1f} | {p.checking:.1f} "
            f"| {t['out_of_memory_retries']:.0f} | {t['idle_pools_ended']:.0f} |"
        )
    lines += per_world_lines(rows, phases)
    # The longest modules bound a session's wall time (each runs on one xdist worker).
    modules = sorted(((sec, step, m) for step, p in phases.items() for m, sec in p.modules.items()), reverse=True)
    lines += ["", phase_totals(phases)]
    lines += ["", "| slowest test modules | step | case s |", "|---|---|---:|"]
    lines += [f"| {module} | {step} | {seconds:.1f} |" for seconds, step, module in modules[:SLOWEST_SHOWN]]
    if xfails:
        lines += ["", "| expected failure | step | reason |", "|---|---|---|"]
        lines += [f"| `{name}` | {step} | {reason.replace('|', '/')} |" for step, name, reason in xfails]
    if xpasses:
        lines += ["", "| XPASS: known defect that did not show | step | reason |", "|---|---|---|"]
        lines += [f"| `{nodeid}` | {step} | {reason.replace('|', '/')} |" for step, nodeid, reason in xpasses]
    return "\n".join(lines)


def kernel_table(out: Path, runs: list[SessionRun]) -> str:
    """Which kernel computed dsv41's sparse-MLA calls per session and W, and the real kernel's
    worst error against the reference kernel over CONTRACT.md §8.1's tolerance."""
    lines = [line for run in runs for line in cross_check.summary_lines(run.name, out / f"{run.name}.kernels.jsonl")]
    if not lines:
        return ""
    head = "| session | W | kernel | calls | worst real-vs-reference err/tol |\n|---|---:|---|---:|---:|\n"
    return "\n## Sparse-MLA kernels (dsv41)\n\n" + head + "\n".join(lines) + "\n"


def xpass_lines(xpasses: list[tuple[str, str, str]]) -> list[str]:
    """The run's closing lines: one per XPASS, so that none goes unnoticed in a passing run."""
    return [f"{XPASS_NOTE}: {nodeid}" + (f" — {reason}" if reason else "") for _, nodeid, reason in xpasses]
