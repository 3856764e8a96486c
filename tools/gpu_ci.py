#!/usr/bin/env python3
"""Pre-merge GPU CI: the staged suite on the GPUs of this host.

Runs, in order, one pytest process per step with ``--device cuda`` and
``--junitxml``: the harness self-tests (spawned pool: failing, stuck and
killed ranks), stage 1, stage 3, stage 9, end to end, the realistic-shape GPU
tests of tests/gpu (in one process: their cases need tens of GiB), then the stage tests once more
under ``torchrun --nproc-per-node <max(GPUs, 2)>``. World sizes above the GPU
count share GPUs over gloo (``--gpu-sharing``), so a one-GPU host runs them
all. Then it reads the JUnit files and prints a summary (step x stage x W x
backend x ranks: cases passed / failed / skipped, worst error, peak GPU
memory), also written to ``<out>/summary.md``; the ranks column says which
cases ran on NCCL and which on gloo. Exits 1 when a case failed or a step
broke, 2 when the host has no GPU.

    python tools/gpu_ci.py --out gpu-ci            # on a GPU host, from the repo root
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from dcpcheck.plugin.runner import GPU_PEAK_PROPERTY

REPO = Path(__file__).resolve().parents[1]

# (step, test paths) in run order, each under --workers xdist workers.
POOL_STEPS = (
    ("harness", ("tests/selftest",)),
    ("stage1", ("tests/stage1_index",)),
    ("stage3", ("tests/stage3_combine",)),
    ("stage9", ("tests/stage9_prefill",)),
    ("e2e", ("tests/e2e",)),
)
# The realistic-shape GPU tests run in one process: one case needs up to tens
# of GiB, and the ranks of concurrent xdist workers would share that memory.
SERIAL_STEPS = (("realistic", ("tests/gpu/test_*.py",)),)
TORCHRUN_PATHS = ("tests/stage1_index", "tests/stage3_combine", "tests/stage9_prefill", "tests/e2e", "tests/gpu")
PYTEST_NO_TESTS = 5  # pytest's exit code when nothing was collected


def expand(patterns) -> list[str]:
    """Existing test paths of ``patterns`` (globs relative to the repo)."""
    found = []
    for pattern in patterns:
        found += sorted(str(p.relative_to(REPO)) for p in REPO.glob(pattern) if p.name != "__init__.py")
    return found


def pytest_args(args, paths: list[str], junit: Path, *, workers: int = 0) -> list[str]:
    return [
        "-m", "pytest", *paths, "-q", "-rfE", "-p", "no:cacheprovider",
        # loadfile: a test file stays on one xdist worker, whose ranks then
        # build each shared realistic scenario once.
        *(["-n", str(workers), "--dist", "loadfile"] if workers else []),
        "--device", args.device, "--dcp-timeout", str(args.dcp_timeout), "--junitxml", str(junit),
        *(["--world-sizes", args.world_sizes] if args.world_sizes else []),
        *args.pytest_args,
    ]  # fmt: skip


def run_step(name: str, argv: list[str], out: Path) -> tuple[int, float]:
    """Run one step, its output both on stdout and in ``<out>/<name>.log``."""
    print(f"\n=== {name}: {' '.join(argv)}", flush=True)
    started = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        code = proc.wait()
    seconds = time.perf_counter() - started
    print(f"=== {name}: exit {code} in {seconds:.1f} s", flush=True)
    return code, seconds


# ---- the summary ------------------------------------------------------------


@dataclass
class Row:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    worst_ratios: list = field(default_factory=list)
    max_abs_errs: list = field(default_factory=list)
    gpu_peak_bytes: int = 0


def case_key(step: str, case: ET.Element) -> tuple[str, str, str, str, str]:
    """(step, stage, W, backend, ranks) of a JUnit testcase, from the
    properties the plugin records, else from the test id (skipped cases have
    none)."""
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    name = case.get("name", "")
    world = props.get("dcp_world_size") or next(iter(re.findall(r"[\[-]W(\d+)[-\]]", name)), "-")
    backend = props.get("dcp_backend") or next(iter(re.findall(r"\b(ag_rs|a2a)\b", name)), "-")
    return step, props.get("dcp_stage", "harness"), world, backend, props.get("dcp_ranks", "-")


def summarize(junit_files: dict[str, Path]) -> dict[tuple, Row]:
    rows: dict[tuple, Row] = defaultdict(Row)
    for step, path in junit_files.items():
        if not path.exists():
            continue
        for case in ET.parse(path).iter("testcase"):
            row = rows[case_key(step, case)]
            if case.find("failure") is not None or case.find("error") is not None:
                row.failed += 1
            elif case.find("skipped") is not None:
                row.skipped += 1
            else:
                row.passed += 1
                props = {p.get("name"): p.get("value") for p in case.iter("property")}
                if "dcp_worst_ratio" in props:
                    row.worst_ratios.append(float(props["dcp_worst_ratio"]))
                if "dcp_max_abs_err" in props:
                    row.max_abs_errs.append(float(props["dcp_max_abs_err"]))
                peaks = [int(v) for k, v in props.items() if k.startswith(GPU_PEAK_PROPERTY)]
                row.gpu_peak_bytes = max([row.gpu_peak_bytes, *peaks])
    return rows


def render(rows: dict[tuple, Row], timings: dict[str, tuple[int, float]]) -> str:
    """A markdown table: one line per (step, stage, W, backend)."""
    lines = [
        "| step | stage | W | backend | ranks | cases | passed | failed | skipped | worst err/tol | max abs err "
        "| peak GPU GiB |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def order(key):
        step, stage, world, backend, _ = key
        return (
            list(timings).index(step) if step in timings else 99,
            stage,
            int(world) if world.isdigit() else 0,
            backend,
        )

    for key in sorted(rows, key=order):
        row = rows[key]
        ratio = f"{max(row.worst_ratios):.3g}" if row.worst_ratios else "-"
        abs_err = f"{max(row.max_abs_errs):.3g}" if row.max_abs_errs else "-"
        peak = f"{row.gpu_peak_bytes / 2**30:.2f}" if row.gpu_peak_bytes else "-"
        cases = row.passed + row.failed + row.skipped
        lines.append(
            f"| {' | '.join(key)} | {cases} | {row.passed} | {row.failed} | {row.skipped} | {ratio} | {abs_err} "
            f"| {peak} |"
        )
    lines += ["", "| step | exit | seconds |", "|---|---:|---:|"]
    lines += [f"| {step} | {code} | {seconds:.1f} |" for step, (code, seconds) in timings.items()]
    return "\n".join(lines)


# ---- the driver -------------------------------------------------------------


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-ci"), help="folder for JUnit XML, logs and summary.md")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run of the driver itself")
    parser.add_argument("--world-sizes", default=None, help="passed to pytest (default: the plugin's, 1,2,4,8 on CUDA)")
    parser.add_argument("--dcp-timeout", type=float, default=60.0, help="seconds one multi-rank case may take")
    parser.add_argument(
        "--steps",
        default=None,
        help="comma-separated subset of: " + ",".join(s for s, _ in POOL_STEPS + SERIAL_STEPS) + ",torchrun",
    )
    parser.add_argument("--workers", type=int, default=0, help="pytest-xdist workers per pool step (0: none)")
    parser.add_argument("--fail-fast", action="store_true", help="stop after the first step with a failure")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    gpus = gpu_count() if args.device == "cuda" else 0
    if args.device == "cuda" and gpus == 0:
        print("gpu_ci: no CUDA device visible; run it on a GPU host (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    wanted = set(args.steps.split(",")) if args.steps else None
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()

    steps = [
        (name, pytest_args(args, expand(paths), out / f"{name}.xml", workers=args.workers))
        for name, paths in POOL_STEPS
        if expand(paths)
    ]
    steps += [(name, pytest_args(args, expand(paths), out / f"{name}.xml")) for name, paths in SERIAL_STEPS]
    ranks = max(gpus, 2)  # on one GPU the torchrun ranks share it over gloo
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    steps.append(("torchrun", torchrun + pytest_args(args, expand(TORCHRUN_PATHS), out / "torchrun.xml")))

    timings: dict[str, tuple[int, float]] = {}
    broken = False
    for name, step_args in steps:
        if wanted is not None and name not in wanted:
            continue
        code, seconds = run_step(name, [sys.executable, *step_args], out)
        timings[name] = (code, seconds)
        broken |= code not in (0, PYTEST_NO_TESTS)
        if broken and args.fail_fast:
            break

    rows = summarize({name: out / f"{name}.xml" for name in timings})
    table = render(rows, timings)
    total = sum(seconds for _, seconds in timings.values())
    header = f"# dcpcheck GPU CI\n\ndevice={args.device} GPUs={gpus} total {total:.1f} s\n\n"
    (out / "summary.md").write_text(header + table + "\n")
    print("\n" + header + table)
    failed = broken or any(row.failed for row in rows.values())
    print(f"\ngpu_ci: {'FAILED' if failed else 'passed'} (JUnit XML, logs and summary.md in {out})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
