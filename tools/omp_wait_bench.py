#!/usr/bin/env python3
"""What OpenMP's wait policy costs processes that share the cores (dcpcheck/ranks/host_threads.py).

A GPU host's ranks each run a little host-side torch work (here: the float64 oracle of one rank's spot rows,
``dcpcheck.oracle.attention.sparse_attention``), then wait, for their GPU (a blocking sync sleeps: the
``--gap`` here) or for Python, and many such processes share the cores. This runs ``--processes`` of them, each
with ``--threads`` OpenMP threads, under the default wait policy and under ``OMP_WAIT_POLICY=PASSIVE``,
alternated ``--repeats`` times, and reports each policy's median wall seconds and the CPU seconds the
processes used (``getrusage`` of the children):

    python tools/omp_wait_bench.py --report reports/omp_wait_policy_cpu.md
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO))

from cli_arguments import OneLineParser, file_problem  # noqa: E402

from dcpcheck.ranks.host_threads import IDLE_THREADS_SLEEP, WAIT_POLICY_VARIABLE  # noqa: E402  (what it measures)

POLICIES = ("default", IDLE_THREADS_SLEEP)  # default: the policy variable unset, as a process starts unless told

# One rank's oracle work a step: ``rows`` spot rows of ``heads`` heads of ``dim`` over ``top_k`` compressed and
# ``window`` window candidates (production's per-rank shape at W = 8: 64 spot rows, 16 heads of 512, top-k 2048
# has some 40 times this).
RANK = """
import sys, time
import torch
from dcpcheck.oracle.attention import sparse_attention

rows, heads, dim, top_k, window, steps, gap = map(float, sys.argv[1:])
rows, heads, dim, top_k, window, steps = map(int, (rows, heads, dim, top_k, window, steps))
g = torch.Generator().manual_seed(0)
q = torch.randn(rows, heads, dim, generator=g).bfloat16()
comp = torch.randn(rows * top_k, dim, generator=g).bfloat16()
comp_slots = torch.randperm(rows * top_k, generator=g).view(rows, top_k)
swa = torch.randn(rows * window, dim, generator=g).bfloat16()
swa_slots = torch.arange(rows * window).view(rows, window)
sink = torch.randn(heads, generator=g)
for _ in range(steps):
    sparse_attention(q, comp, comp_slots, swa, swa_slots, sink, scale=dim**-0.5)
    time.sleep(gap)
"""


def run_once(args, policy: str) -> tuple[float, float]:
    """(wall s, the processes' CPU s) of ``args.processes`` ranks under ``policy``."""
    env = {k: v for k, v in os.environ.items() if k != WAIT_POLICY_VARIABLE}
    env.update(OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(REPO))
    if policy != "default":
        env[WAIT_POLICY_VARIABLE] = policy
    shape = [args.rows, args.heads, args.dim, args.top_k, args.window, args.steps, args.gap]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, *map(str, shape)], env=env) for _ in range(args.processes)]
    codes = [rank.wait() for rank in ranks]
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if any(codes):
        raise SystemExit(f"a rank exited with {codes}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def measure(args) -> dict[str, list[tuple[float, float]]]:
    runs: dict[str, list[tuple[float, float]]] = {policy: [] for policy in POLICIES}
    for repeat in range(args.repeats):
        for policy in POLICIES if repeat % 2 == 0 else POLICIES[::-1]:  # alternated: drift hits both alike
            runs[policy].append(run_once(args, policy))
    return runs


def render(args, runs) -> str:
    lines = [
        "# OpenMP's wait policy, processes sharing the cores",
        "",
        f"`python tools/omp_wait_bench.py {' '.join(args.argv)}` on {os.cpu_count()} cores: {args.processes} "
        f"processes of {args.threads} threads, each {args.steps} steps of the float64 oracle "
        f"({args.rows} rows x {args.heads} heads x {args.dim} over {args.top_k} + {args.window} candidates) "
        f"and a {args.gap:g} s wait; the policies alternated, {args.repeats} runs each.",
        "",
        "| OMP_WAIT_POLICY | median wall s | median CPU s | CPU s per run | wall s per run |",
        "|---|---:|---:|---|---|",
    ]
    for policy, samples in runs.items():
        walls, cpus = [wall for wall, _ in samples], [cpu for _, cpu in samples]
        lines.append(
            f"| {policy} | {statistics.median(walls):.2f} | {statistics.median(cpus):.2f} | "
            f"{', '.join(f'{cpu:.2f}' for cpu in cpus)} | {', '.join(f'{wall:.2f}' for wall in walls)} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv) -> argparse.Namespace:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    for name, default, kind in (
        ("processes", 2 * (os.cpu_count() or 1), int),
        ("threads", 2, int),
        ("steps", 20, int),
        ("repeats", 3, int),
        ("rows", 16, int),
        ("heads", 8, int),
        ("dim", 512, int),
        ("top-k", 512, int),
        ("window", 128, int),
        ("gap", 0.05, float),
    ):
        parser.add_argument(f"--{name}", type=kind, default=default, help=f"default {default}")
    parser.add_argument("--report", type=Path, help="write the markdown here too")
    args = parser.parse_args(argv)
    args.argv = list(argv)
    for name in ("processes", "threads", "steps", "repeats", "rows", "heads", "dim", "top_k", "window", "gap"):
        least = 0 if name in ("top_k", "window", "gap") else 1
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: accepted: {least} or more")
    if args.report is not None and (problem := file_problem(args.report)):
        parser.error(f"--report {args.report}: {problem}; accepted: a file whose folder exists or can be made")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    report = render(args, measure(args))
    print(report, end="")
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
