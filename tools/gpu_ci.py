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

This module is the command line: it checks the arguments, plans the sessions
and writes the summary. Beside it: gpu_ci_sessions.py (the session table),
gpu_ci_launch.py (running the sessions), gpu_ci_load.py (the host's load meanwhile; gpu_ci_process_cpu.py: whose
processes the cores worked for), gpu_ci_plugin.py (the pytest plugin
each session loads), gpu_ci_junit.py (reading their JUnit files back) and
gpu_ci_summary.py (the markdown).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cli_arguments import OneLineParser, file_problem, folder_problem  # noqa: E402  (tools/, beside this file)
from gpu_ci_junit import cut_by_timeout, missing_breakdown, summarize  # noqa: E402
from gpu_ci_launch import SessionRun, default_workers, run_sessions, session_argv, session_workers  # noqa: E402
from gpu_ci_plugin import PLUGIN, with_plugin_path  # noqa: E402, F401  (PLUGIN: the self-tests read it here)
from gpu_ci_sessions import LONGEST_FIRST, NEEDS_VLLM, SESSIONS, STEP_NAMES, Session  # noqa: E402
from gpu_ci_summary import kernel_table, render, xpass_lines  # noqa: E402
from session_cut import PROGRESS_ENV  # noqa: E402

# Imported once this checkout is on the path: a GPU host has dcpcheck as a checkout, not installed.
from dcpcheck.impls.dsv41.kernels import cross_check  # noqa: E402
from dcpcheck.impls.dsv41.kernels.selection import installed_version  # noqa: E402
from dcpcheck.plugin.file_durations import durations_path, handed_out_order, read_durations, table_key  # noqa: E402
from dcpcheck.plugin.options import MAX_TIMEOUT_S, parse_world_sizes  # noqa: E402
from dcpcheck.ranks.host_threads import idle_threads_sleep  # noqa: E402

PYTEST_NO_TESTS = 5  # pytest's exit code when nothing was collected
SPREAD_ENV = "DCPCHECK_XDIST_SPREAD"  # tests/conftest.py: one xdist group per file, in command-line order


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
        # Every process of every session (pytest, its workers, torchrun's ranks, the pools' servers) shares the
        # cores: their idle OpenMP threads sleep (dcpcheck/ranks/host_threads.py).
        idle_threads_sleep(env)
        wave = 0 if args.one_wave else session.wave
        workers = session_workers(args, session)
        runs.append(SessionRun(session.name, argv_, env, REPO, wave, tuple(step_paths), workers))
        junit_files[junit] = step_paths
        sessions.append(session)
    return runs, junit_files, sessions, left_out


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
    waves = run_sessions(runs, out, args.session_timeout, gpus)
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
    header = (
        f"# dcpcheck GPU CI\n\ndevice={args.device} GPUs={gpus} cores={cores} pool workers={args.workers} "
        f"wall {wall:.1f} s ({', '.join(f'wave {n} {wave.seconds:.1f} s' for n, wave in waves.items())})\n\n"
    )
    header += "".join(f"- wave {n}: {wave.load.describe()}\n" for n, wave in waves.items()) + "\n"
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
