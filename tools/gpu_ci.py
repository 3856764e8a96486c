#!/usr/bin/env python3
"""Pre-merge GPU CI: the staged suite on the GPUs of this host.

The suite's steps (harness self-tests, stage 1, stage 3, stage 9, end to end,
the realistic-shape GPU tests of tests/gpu, then the stage tests and the
realistic ones under ``torchrun``) run in a few *sessions*, all at once: one
pytest process with ``--workers`` xdist workers for every pool step (so each
worker starts its rank pools once, not once per step), and two ``torchrun
--nproc-per-node <max(GPUs, 2)>`` jobs. Where vLLM imports, a second wave
runs the stage tests against vLLM and its DCP2 port. Each session runs with
``--device cuda`` and ``--junitxml``; world sizes above the GPU count share
GPUs over gloo (``--gpu-sharing``), so a one-GPU host runs them all.

Then it reads the JUnit files and prints a summary: step x stage x W x
backend x ranks (cases passed / failed / xfailed / xpassed / skipped, worst
error, peak GPU memory; the ranks column says which cases ran on NCCL and
which on gloo), and where each step's time went: pool start (of which CUDA
context and group set-up, the slowest rank), Triton compiles, and the
checking itself. It is also written to ``<out>/summary.md`` (and
``--report``); the run ends with one line per XPASS. Exits 1 when a case
failed, a session broke or a session's breakdown is missing, 2 when the host
has no GPU or an argument is bad (one line, before any session starts).

    python tools/gpu_ci.py --out gpu-ci            # on a GPU host, from the repo root
    python tools/gpu_ci.py --device cpu --steps stage1 --out gpu-ci-dry   # the driver's dry run
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Loaded as a pytest plugin (PLUGIN) before the suite's conftest loads dcpcheck's: so
# that pytest still rewrites that plugin's asserts (and warns of nothing), it is told first.
pytest.register_assert_rewrite("dcpcheck.plugin")
from cli_arguments import OneLineParser, file_problem, folder_problem  # noqa: E402  (tools/, beside this file)
from gpu_ci_sessions import (  # noqa: E402
    LONGEST_FIRST,
    NEEDS_VLLM,
    PER_WORLD_STEPS,
    SESSIONS,
    STEP_NAMES,
    Session,
)
from session_cut import (  # noqa: E402, F401  (the hooks: this module is the sessions' plugin)
    PROGRESS_ENV,
    cut_cases,
    cut_row_key,
    pytest_runtest_logfinish,
    pytest_runtest_logstart,
)

# Imported once this checkout is on the path: a GPU host has dcpcheck as a checkout, not installed.
from dcpcheck.impls.dsv41.kernels import cross_check  # noqa: E402
from dcpcheck.impls.dsv41.kernels.selection import installed_version  # noqa: E402
from dcpcheck.plugin import junit_properties as prop  # noqa: E402
from dcpcheck.plugin.file_durations import durations_path, handed_out_order, read_durations, table_key  # noqa: E402
from dcpcheck.plugin.options import MAX_TIMEOUT_S, parse_world_sizes  # noqa: E402

PYTEST_NO_TESTS = 5  # pytest's exit code when nothing was collected
SLOWEST_SHOWN = 8  # test modules listed by their cases' seconds
SPREAD_ENV = "DCPCHECK_XDIST_SPREAD"  # tests/conftest.py: one xdist group per file, in command-line order
# pytest writes an XPASS to JUnit as a plain passed testcase, without its
# reason: this module, loaded in every session as a pytest plugin, records both there.
PLUGIN = "gpu_ci"
XPASS_NODEID = "gpu_ci_xpass_nodeid"
XPASS_REASON = "gpu_ci_xpass_reason"
XPASS_NOTE = "XPASS (a known defect did not show: fixed, or its case missed it)"


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outside pytest's skipping plugin, which marks the XPASS
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" and report.passed and hasattr(report, "wasxfail"):
        # The teardown report copies the item's properties; JUnit writes those.
        item.user_properties += [(XPASS_NODEID, item.nodeid), (XPASS_REASON, report.wasxfail)]
    return report


def with_plugin_path(env: dict) -> dict:
    """``env`` with this folder on PYTHONPATH, so that ``-p gpu_ci`` finds this module."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))}


def vllm_missing() -> str | None:
    """Why the vLLM sessions cannot run here (vLLM does not import), else None."""
    probe = subprocess.run([sys.executable, "-c", "import vllm"], cwd=REPO, capture_output=True, text=True)
    if probe.returncode == 0:
        return None
    last = (probe.stderr.strip().splitlines() or ["exit status " + str(probe.returncode)])[-1]
    return f"vLLM does not import here ({last}); install it (tools/install_vllm_cpu.sh, or tools/carry_vllm.py)"


def expand(patterns) -> list[str]:
    """The test files of ``patterns`` (globs relative to the repo: files or folders)."""
    found = []
    for pattern in patterns:
        for path in sorted(REPO.glob(pattern)):
            files = sorted(path.rglob("test_*.py")) if path.is_dir() else [path]
            found += [str(f.relative_to(REPO)) for f in files if f.name.startswith("test_")]
    return found


def longest_first(paths: list[str], measured: dict[str, float]) -> list[str]:
    order = handed_out_order(measured, LONGEST_FIRST)
    return sorted(paths, key=lambda path: order.index(path) if path in order else len(order))


def measured_durations(device: str, session: Session) -> dict[str, float]:
    """Each test file's seconds in this host's last whole session of ``device`` and the session's implementation."""
    impl = (
        session.extra_args[session.extra_args.index("--dcp-impl") + 1] if "--dcp-impl" in session.extra_args else "port"
    )
    return read_durations(durations_path(REPO), table_key(device, impl))


def default_workers(gpus: int, cores: int) -> int:
    """xdist workers for the pool session: each starts a pool per world size
    (1 + 2 + 4 + 8 ranks, a CUDA context each) on the shared GPUs, so not
    more than 5 per GPU (on one H200, 8 workers ran it out of memory at pool
    starts, beside the realistic cases), and 3 cores each; 8 at most."""
    return max(1, min(8, 5 * max(gpus, 1), cores // 3))


def _xdist_keeps_order() -> list[str]:
    """pytest-xdist >= 3.7 reorders groups by test count unless told not to."""
    try:
        major, minor = (int(part) for part in metadata.version("pytest-xdist").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return []
    return ["--no-loadscope-reorder"] if (major, minor) >= (3, 7) else []


def session_argv(args, session: Session, paths: list[str], junit: Path, *, gpus: int) -> list[str]:
    pytest = [
        "-m", "pytest", *paths, "-q", "-rfE", "-p", "no:cacheprovider", "-p", PLUGIN,
        "--device", args.device, "--dcp-timeout", str(args.dcp_timeout), "--junitxml", str(junit),
        *(["--world-sizes", args.world_sizes] if args.world_sizes else []),
        *(["-x"] if args.fail_fast else []), *session.extra_args, *args.pytest_args,
    ]  # fmt: skip
    if session.torchrun:
        ranks = max(gpus, 2)  # on one GPU the torchrun ranks share it over gloo
        # --standalone picks a free rendezvous port, so two jobs can run at once.
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *pytest]
    workers = max(1, int(args.workers * session.workers_share))
    if workers > 1:
        # A test file (a realistic one: each half) stays on one xdist worker,
        # whose ranks then build each shared scenario once (tests/conftest.py).
        pytest += ["-n", str(workers), "--dist", "loadgroup", *_xdist_keeps_order()]
    return [sys.executable, *pytest]


@dataclass
class SessionRun:
    name: str
    argv: list[str]
    env: dict
    wave: int = 0
    code: int | None = None
    seconds: float = 0.0
    timed_out: bool = False  # stopped by --session-timeout

    @property
    def progress(self) -> Path:
        """Where its cases' starts and ends are written (tools/session_cut.py)."""
        return Path(self.env[PROGRESS_ENV])


def _stop(run: SessionRun, proc: subprocess.Popen, timeout: float, lock: threading.Lock) -> None:
    run.timed_out = True
    with lock:
        print(f"=== {run.name}: --session-timeout {timeout:g} s reached: stopping it (SIGINT)", flush=True)
    proc.send_signal(signal.SIGINT)


def _stream(run: SessionRun, out: Path, lock: threading.Lock, timeout: float | None) -> None:
    """Run one session, its output on stdout (prefixed with its name) and in ``<out>/<name>.log``.
    After ``timeout`` seconds it gets SIGINT: pytest then stops and still writes its JUnit XML."""
    with lock:
        print(f"\n=== {run.name}: {' '.join(run.argv)}", flush=True)
    started = time.perf_counter()
    with open(out / f"{run.name}.log", "w") as log:
        proc = subprocess.Popen(
            run.argv, cwd=REPO, env=run.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        timer = threading.Timer(timeout, _stop, (run, proc, timeout, lock)) if timeout else None
        if timer:
            timer.start()
        for line in proc.stdout:
            log.write(line)
            with lock:
                sys.stdout.write(f"[{run.name}] {line}")
        run.code = proc.wait()
        if timer:
            timer.cancel()
    run.seconds = time.perf_counter() - started
    with lock:
        print(f"=== {run.name}: exit {run.code} in {run.seconds:.1f} s", flush=True)


def run_sessions(runs: list[SessionRun], out: Path, timeout: float | None) -> dict[int, float]:
    """Each wave's sessions at once (they share the GPUs and the cores), the
    waves in turn -> each wave's wall seconds."""
    lock = threading.Lock()
    walls = {}
    for wave in sorted({run.wave for run in runs}):
        started = time.perf_counter()
        threads = [threading.Thread(target=_stream, args=(run, out, lock, timeout)) for run in runs if run.wave == wave]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        walls[wave] = time.perf_counter() - started
    return walls


# ---- the summary ------------------------------------------------------------


@dataclass
class Row:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    xfailed: int = 0
    xpassed: int = 0
    worst_ratios: list = field(default_factory=list)
    max_abs_errs: list = field(default_factory=list)
    gpu_peak_bytes: int = 0

    @property
    def cases(self) -> int:
        return self.passed + self.failed + self.xfailed + self.xpassed + self.skipped

    def add_measures(self, props: dict) -> None:
        """A case's worst errors and GPU peak (one that ran its checks to the end: passed or XPASS)."""
        worst_ratio, max_abs_err = (prop.measured(key) for key in prop.WORST_ERROR_KEYS)
        if worst_ratio in props:
            self.worst_ratios.append(float(props[worst_ratio]))
        if max_abs_err in props:
            self.max_abs_errs.append(float(props[max_abs_err]))
        peaks = [int(v) for k, v in props.items() if k.startswith(prop.GPU_PEAK_PREFIX)]
        self.gpu_peak_bytes = max([self.gpu_peak_bytes, *peaks])


@dataclass
class Phases:
    """Where one step's time went, summed over its cases (which run in
    several xdist workers at once: the sums exceed the wall time)."""

    cases: int = 0
    seconds: float = 0.0  # the cases' own durations (JUnit), pool starts and compiles included
    totals: dict = field(default_factory=lambda: dict.fromkeys(prop.PHASES, 0.0))
    modules: dict = field(default_factory=lambda: defaultdict(float))  # test module -> its cases' seconds
    worlds: dict = field(default_factory=lambda: defaultdict(float))  # W -> its cases' seconds

    @property
    def checking(self) -> float:
        return self.seconds - self.totals["pool_start_s"] - self.totals["compile_s"]


def case_key(step: str, case: ET.Element) -> tuple[str, str, str, str, str]:
    """(step, stage, W, backend, ranks) of a JUnit testcase, from the
    properties the plugin records, else from the test id (skipped cases have
    none)."""
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    name = case.get("name", "")
    world = props.get(prop.WORLD_SIZE) or next(iter(re.findall(r"[\[-]W(\d+)[-\]]", name)), "-")
    backend = props.get(prop.BACKEND) or next(iter(re.findall(r"\b(ag_rs|a2a)\b", name)), "-")
    return step, props.get(prop.STAGE, "harness"), world, backend, props.get(prop.RANKS, "-")


def step_of(case: ET.Element, step_paths: dict[str, list[str]]) -> str | None:
    """The step whose test paths hold this JUnit testcase (by its dotted classname)."""
    classname = case.get("classname", "")
    for step, paths in step_paths.items():
        for path in paths:
            module = path.removesuffix(".py").replace("/", ".")
            if classname == module or classname.startswith(module + "."):
                return step
    return None


def summarize(
    junit_files: dict[Path, dict[str, list[str]]],
) -> tuple[dict[tuple, Row], dict[str, Phases], list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    """-> (summary rows, per-step phases, expected failures as (step, case,
    reason), XPASSes as (step, node id, reason)) of the JUnit files, each with
    the paths of the steps it ran."""
    rows: dict[tuple, Row] = defaultdict(Row)
    phases: dict[str, Phases] = defaultdict(Phases)
    xfails: list[tuple[str, str, str]] = []
    xpasses: list[tuple[str, str, str]] = []
    for path, step_paths in junit_files.items():
        if not path.exists():
            continue
        for case in ET.parse(path).iter("testcase"):
            step = step_of(case, step_paths) or next(iter(step_paths))
            props = {p.get("name"): p.get("value") for p in case.iter("property")}
            step_phases = phases[step]
            step_phases.cases += 1
            step_phases.seconds += float(case.get("time") or 0.0)
            step_phases.modules[case.get("classname", "").split("::")[0]] += float(case.get("time") or 0.0)
            step_phases.worlds[case_key(step, case)[2]] += float(case.get("time") or 0.0)
            for phase in prop.PHASES:
                step_phases.totals[phase] += float(props.get(prop.measured(phase), 0.0))
            row = rows[case_key(step, case)]
            skipped = case.find("skipped")
            if case.find("failure") is not None or case.find("error") is not None:
                row.failed += 1
            elif skipped is not None and skipped.get("type") == "pytest.xfail":
                row.xfailed += 1
                xfails.append((step, case.get("name", ""), skipped.get("message", "").removeprefix("xfail: ")))
            elif skipped is not None:
                row.skipped += 1
            elif XPASS_NODEID in props:
                row.xpassed += 1
                xpasses.append((step, props[XPASS_NODEID], props.get(XPASS_REASON, "")))
                row.add_measures(props)
            else:
                row.passed += 1
                row.add_measures(props)
    return rows, phases, xfails, xpasses


def missing_breakdown(session: Session, phases: dict[str, Phases], device: str, ran_cases: bool) -> str | None:
    """Why the session's per-phase breakdown is missing, else None: a pool
    session that ran multi-rank cases must have timed its pool starts (and,
    on CUDA, the ranks' CUDA contexts)."""
    if session.torchrun or not ran_cases:
        return None
    totals = {
        phase: sum(phases[s.name].totals[phase] for s in session.steps if s.name in phases) for phase in prop.PHASES
    }
    needed = ("pool_start_s", "cuda_init_s") if device == "cuda" else ("pool_start_s",)
    absent = [phase for phase in needed if totals[phase] <= 0]
    if absent:
        return f"session {session.name}: no {', '.join(absent)} recorded by any case (JUnit properties dcp_<phase>)"
    return None


def phase_totals(phases: dict[str, Phases]) -> str:
    """One line: every step's phases summed (the CI's timing budget, read at a glance)."""
    totals = {phase: sum(p.totals[phase] for p in phases.values()) for phase in prop.PHASES}
    seconds = sum(p.seconds for p in phases.values())
    checking = seconds - totals["pool_start_s"] - totals["compile_s"]
    return (
        f"phases, summed over every case: cases {seconds:.1f} s = pool start {totals['pool_start_s']:.1f} "
        f"(CUDA init {totals['cuda_init_s']:.1f}, group init {totals['group_init_s']:.1f}) "
        f"+ compile {totals['compile_s']:.1f} + checking {checking:.1f}; "
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
    lines += ["", "| session | wave | exit | wall s |", "|---|---:|---:|---:|"]
    lines += [f"| {run.name} | {run.wave} | {run.code} | {run.seconds:.1f} |" for run in runs]
    lines += [
        "",
        "Per step, summed over its cases (concurrent workers: sums exceed wall time). Pool start holds CUDA init "
        "and group init (the slowest rank of each start); checking = case seconds - pool start - compile; "
        "OOM retries: pool starts that ran out of GPU memory and were tried again; pools ended: idle pools a "
        "worker ended before a case, its GPU short of free memory.",
        "",
        "| step | cases | case s | pool start s | CUDA init s | group init s | compile s | checking s | OOM retries "
        "| pools ended |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for step in sorted(phases, key=lambda s: order.index(s) if s in order else 99):
        p = phases[step]
        t = p.totals
        lines.append(
            f"| {step} | {p.cases} | {p.seconds:.1f} | {t['pool_start_s']:.1f} | {t['cuda_init_s']:.1f} "
            f"| {t['group_init_s']:.1f} | {t['compile_s']:.1f} | {p.checking:.1f} | {t['out_of_memory_retries']:.0f} "
            f"| {t['idle_pools_ended']:.0f} |"
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


# ---- the driver -------------------------------------------------------------


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def bad_seconds(value: float) -> bool:
    """nan, inf, 0 and negatives end every wait at once or never; past MAX_TIMEOUT_S timers overflow."""
    return not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S)


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """The plugin's rules, before any session starts, so that a bad value costs no run."""
    seconds = f"expected a finite number of seconds above 0 and at most {MAX_TIMEOUT_S:g}"
    if bad_seconds(args.dcp_timeout):
        parser.error(f"--dcp-timeout {args.dcp_timeout:g}: {seconds}, e.g. 60")
    if args.session_timeout is not None and bad_seconds(args.session_timeout):
        parser.error(f"--session-timeout {args.session_timeout:g}: {seconds}, e.g. 3600")
    if args.world_sizes is not None:
        try:
            parse_world_sizes(args.world_sizes)
        except pytest.UsageError as exc:
            parser.error(str(exc))
    if problem := folder_problem(args.out):
        parser.error(f"--out {args.out}: {problem}; accepted: a folder that exists or can be made")
    if args.report is not None and (problem := file_problem(args.report)):
        parser.error(f"--report {args.report}: {problem}; accepted: a file whose folder exists or can be made")
    if args.steps is not None:
        unknown = sorted(set(args.steps.split(",")) - set(STEP_NAMES))
        if unknown:
            parser.error(f"--steps: unknown {', '.join(unknown)}; accepted: {', '.join(STEP_NAMES)}")
    if args.workers is not None and args.workers < 0:
        parser.error(f"--workers {args.workers}: accepted: 0 or 1 (no xdist), or more")


def parse_args(argv=None):
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-ci"), help="folder for JUnit XML, logs and summary.md")
    parser.add_argument(
        "--report", type=Path, default=None, help="also write the summary here (e.g. reports/gpu_ci.md)"
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run of the driver itself")
    parser.add_argument("--world-sizes", default=None, help="passed to pytest (default: the plugin's, 1,2,4,8 on CUDA)")
    parser.add_argument("--dcp-timeout", type=float, default=60.0, help="seconds one multi-rank case may take")
    parser.add_argument("--steps", default=None, help="comma-separated subset of: " + ",".join(STEP_NAMES))
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="pytest-xdist workers of the pool session (default: by GPUs and cores, see default_workers; 0 or 1: none)",
    )
    parser.add_argument(
        "--one-wave",
        action="store_true",
        help="run every session at once, the vLLM ones beside the pool session (needs both waves' GPU memory at once)",
    )
    parser.add_argument("--fail-fast", action="store_true", help="each session stops after its first failure (-x)")
    parser.add_argument(
        "--session-timeout",
        type=float,
        default=None,
        help="interrupt a session after this many seconds (its finished cases still reach the summary; it fails)",
    )
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def plan(
    args, out: Path, gpus: int
) -> tuple[list[SessionRun], dict[Path, dict[str, list[str]]], list[Session], str | None]:
    """-> (the sessions to run, each session's JUnit file with its steps' test paths, the sessions,
    why the vLLM sessions are left out or None)."""
    wanted = set(args.steps.split(",")) if args.steps else set(STEP_NAMES)
    runs, junit_files, sessions = [], {}, []
    left_out = vllm_missing() if wanted & {s.name for s in NEEDS_VLLM} else None
    for session in SESSIONS:
        if left_out and session in NEEDS_VLLM:
            continue
        step_paths = {s.name: expand(s.paths) for s in session.steps if s.name in wanted and expand(s.paths)}
        if not step_paths:
            continue
        paths = longest_first(
            [path for step in step_paths.values() for path in step], measured_durations(args.device, session)
        )
        junit = out / f"{session.name}.xml"
        junit.unlink(missing_ok=True)
        argv_ = session_argv(args, session, paths, junit, gpus=gpus)
        kernel_log = out / f"{session.name}.kernels.jsonl"  # dsv41's sparse-MLA calls: which kernel, vs the reference
        kernel_log.unlink(missing_ok=True)
        env = with_plugin_path(
            {**os.environ, SPREAD_ENV: "1", cross_check.LOG_ENV: str(kernel_log), **dict(session.env)}
        )
        env[PROGRESS_ENV] = str(out / f"{session.name}.progress")
        Path(env[PROGRESS_ENV]).unlink(missing_ok=True)
        runs.append(SessionRun(session.name, argv_, env, wave=0 if args.one_wave else session.wave))
        junit_files[junit] = step_paths
        sessions.append(session)
    return runs, junit_files, sessions, left_out


def cut_by_timeout(runs: list[SessionRun], junit_files: dict, rows: dict[tuple, Row]) -> dict[str, list[str]]:
    """Session name -> the cases its --session-timeout cut, for each session
    it stopped; each cut case counts as failed in a row of its step, stage "cut"."""
    cut = {}
    steps_of = dict(zip([run.name for run in runs], junit_files.values()))
    for run in runs:
        if not run.timed_out:
            continue
        cut[run.name] = cut_cases(run.progress)
        step_paths = steps_of.get(run.name, {})
        for nodeid in cut[run.name]:
            path = nodeid.split("::")[0]
            step = next((s for s, paths in step_paths.items() if path in paths), next(iter(step_paths), run.name))
            rows[cut_row_key(step, nodeid)].failed += 1
    return cut


def main(argv=None) -> int:
    args = parse_args(argv)
    gpus = gpu_count() if args.device == "cuda" else 0
    if args.device == "cuda" and gpus == 0:
        print("gpu_ci: no CUDA device visible; run it on a GPU host (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    cores = os.cpu_count() or 1
    if args.workers is None:
        args.workers = default_workers(gpus, cores)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()

    runs, junit_files, sessions, left_out = plan(args, out, gpus)
    started = time.perf_counter()
    walls = run_sessions(runs, out, args.session_timeout)
    wall = time.perf_counter() - started

    rows, phases, xfails, xpasses = summarize(junit_files)
    order = [step for session in sessions for step in (s.name for s in session.steps)]
    # A session the time-out stopped is named as such below, not by pytest's exit code for a Ctrl-C.
    broke = [run for run in runs if not run.timed_out and run.code not in (0, PYTEST_NO_TESTS)]
    problems = [f"session {run.name} exited {run.code}" for run in broke]
    cut = cut_by_timeout(runs, junit_files, rows)
    problems += [
        f"session {name}: stopped by --session-timeout {args.session_timeout:g} s (the KeyboardInterrupt above); "
        f"cases cut: {', '.join(nodeids) or 'none running'}"
        for name, nodeids in cut.items()
    ]
    for session in sessions:
        ran = any(phases[s.name].cases for s in session.steps if s.name in phases)
        problem = missing_breakdown(session, phases, args.device, ran)
        if problem:
            problems.append(problem)
    waves = ", ".join(f"wave {wave} {seconds:.1f} s" for wave, seconds in walls.items())
    header = (
        f"# dcpcheck GPU CI\n\ndevice={args.device} GPUs={gpus} cores={cores} pool workers={args.workers} "
        f"wall {wall:.1f} s ({waves})\n\n"
    )
    if left_out:
        header += f"Not run: {', '.join(s.name for s in NEEDS_VLLM)}: {left_out}\n\n"
    flashmla = installed_version("sgl-flash-mla")
    header += f"FlashMLA: {f'sgl-flash-mla {flashmla}' if flashmla else 'not installed (tools/carry_flashmla.py)'}\n\n"
    summary = header + render(rows, phases, runs, order, xfails, xpasses) + kernel_table(out, runs) + "\n"
    (out / "summary.md").write_text(summary)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(summary)
    print("\n" + summary)
    failed = bool(problems) or any(row.failed for row in rows.values())
    for problem in problems:
        print(f"gpu_ci: {problem}")
    print(f"gpu_ci: {'FAILED' if failed else 'passed'} (JUnit XML, logs and summary.md in {out})")
    for line in xpass_lines(xpasses):
        print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
