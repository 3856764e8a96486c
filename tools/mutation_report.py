"""Mutation report: does the suite kill every mutant of the port?

Runs the stage tests against every mutant of ``dcpcheck.mutants.catalog``
(each in its own pytest process, stopping at the first failure, its own
stage's tests first; from the second seed on, the test that killed it first),
then against the clean port, and prints a matrix
mutant x stage saying which test killed each mutant, and the kill rate.

A mutant counts as killed only when a test FAILED (pytest exit code 1 with a
<failure> in the JUnit XML). A collection error, a usage error, a crash of
pytest, the wall-clock limit, or a stale patch (its old text no longer occurs
exactly once in the port; such a mutant is not run) make it *broken*: not
killed. With ``--seeds 0,1,2`` every target runs once per ``--dcp-seed``: a
mutant counts as killed only when every seed kills it, and the clean port must
pass at every seed. Exit code 0 only when every mutant is killed and the clean
port passes.

The "field bugs" section follows the matrix: each public DCP bug report of
docs/field-bugs.md, caught (every mutant carrying its root cause killed),
survived, or not expressible (with the document's reason).

    .venv/bin/python tools/mutation_report.py --jobs 2 --markdown reports/mutation.md
    .venv/bin/python tools/mutation_report.py --seeds 0,1,2 --only PagesCeilOffByOne
    .venv/bin/python tools/mutation_report.py --show OwnerModW   # the mutant's diff
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Imported once this checkout is on the path: its dcpcheck, not an installed one.
from dcpcheck.plugin.junit_properties import STAGE  # noqa: E402
from dcpcheck.stages import STAGE_ENV, STAGES, SUITE_TEST_DIRS  # noqa: E402

# Stage test dirs in suite order; a mutant's own dir (its ``home``) runs first.
TEST_DIRS = SUITE_TEST_DIRS
STAGE_COLUMNS = {stage: f"{stage} {name.split()[-1]}" for stage, name in STAGES.items()}
CATALOG = "dcpcheck.mutants.catalog"
CLEAN_SPEC = "port"


@dataclass(frozen=True)
class Target:
    """One implementation to run the stage tests against."""

    name: str
    spec: str  # the --dcp-impl value
    stage: int | None
    home: str | None
    description: str
    where: str = ""  # the patched definition, file:name
    stale: str | None = None  # why the patch no longer applies to the port

    @property
    def is_mutant(self) -> bool:
        return self.spec != CLEAN_SPEC

    @property
    def dirs(self) -> list[str]:
        ordered = [self.home, *(d for d in TEST_DIRS if d != self.home)] if self.home else list(TEST_DIRS)
        return [d for d in ordered if (ROOT / d).is_dir()]


@dataclass(frozen=True)
class TestCase:
    nodeid: str
    stage: int | None
    outcome: str  # passed, failed, error, skipped
    reason: str  # the telling line of a failure or error


@dataclass
class Run:
    target: Target
    returncode: int | None  # None: not run, or stopped at the wall-clock limit
    seconds: float
    seed: int = 0
    output_tail: str = ""
    cases: list[TestCase] = field(default_factory=list)

    @property
    def first_problem(self) -> TestCase | None:
        return next((case for case in self.cases if case.outcome in ("failed", "error")), None)

    @property
    def killer(self) -> TestCase | None:
        """The FAILED test that killed the mutant, when the run is a kill."""
        problem = self.first_problem
        if self.returncode == 1 and problem is not None and problem.outcome == "failed":
            return problem
        return None

    @property
    def verdict(self) -> str:
        if not self.target.is_mutant:
            return "passes" if self.returncode == 0 else "FAILS"
        if self.killer is not None:
            return "killed" if self.killer.stage == self.target.stage else "killed*"
        return "survived" if self.returncode == 0 else "broken"

    def explain(self, limit: float) -> str:
        """Why the run ended as it did, in one line."""
        if self.target.stale:
            return f"not run: {self.target.stale}"
        if self.killer is not None:
            return f"{self.killer.nodeid}: {self.killer.reason}"
        if self.returncode is None:
            return f"stopped at the {limit:g} s wall-clock limit"
        if self.returncode == 0:
            return f"{sum(case.outcome == 'passed' for case in self.cases)} tests passed"
        problem = self.first_problem
        if problem is not None:
            return f"pytest exit code {self.returncode}, {problem.outcome} {problem.nodeid}: {problem.reason}"
        last_line = (self.output_tail.strip().splitlines() or [""])[-1]
        return f"pytest exit code {self.returncode}: {last_line}"


KILLS = ("killed", "killed*")


@dataclass
class Outcome:
    """A target's runs, one per seed: a mutant is killed only if every seed
    kills it, and the clean port passes only if every seed passes."""

    runs: list[Run]

    @property
    def target(self) -> Target:
        return self.runs[0].target

    @property
    def deciding(self) -> Run:
        """The first run that did not kill (clean port: did not pass), else the first."""
        good = KILLS if self.target.is_mutant else ("passes",)
        return next((run for run in self.runs if run.verdict not in good), self.runs[0])

    @property
    def verdict(self) -> str:
        verdicts = {run.verdict for run in self.runs}
        if self.target.is_mutant and verdicts <= set(KILLS):
            return "killed*" if "killed*" in verdicts else "killed"
        return self.deciding.verdict

    @property
    def seconds(self) -> float:
        return sum(run.seconds for run in self.runs)

    @property
    def returncode(self) -> int | None:
        return self.deciding.returncode

    def explain(self, limit: float) -> str:
        text = self.deciding.explain(limit)
        if len(self.runs) == 1:
            return text
        if self.verdict in KILLS or self.verdict == "passes":
            return f"seeds {','.join(str(run.seed) for run in self.runs)}; seed {self.deciding.seed}: {text}"
        killing = [str(run.seed) for run in self.runs if run.verdict in KILLS]
        also = f" (killed at seed {','.join(killing)})" if killing else ""
        return f"seed {self.deciding.seed}: {text}{also}"


def load_targets(only: list[str]) -> list[Target]:
    from dcpcheck.mutants.catalog import MUTANTS

    names = [m.name for m in MUTANTS]
    unknown = sorted(set(only) - set(names))
    if unknown:
        raise SystemExit(f"no mutant named {unknown}; known: {', '.join(names)}")
    return [
        Target(m.name, f"{CATALOG}:{m.name}", m.stage, m.home, m.description, m.patch.definition(), m.stale())
        for m in MUTANTS
        if not only or m.name in only
    ]


def show(name: str) -> int:
    """Print the mutant's patch as a unified diff of its port file."""
    from dcpcheck.mutants.catalog import BY_NAME
    from dcpcheck.mutants.patch import StalePatch

    if name not in BY_NAME:
        raise SystemExit(f"--show: no mutant named {name!r}; known: {', '.join(BY_NAME)}")
    mutant = BY_NAME[name]
    print(f"# {mutant.name} (stage {mutant.stage}, {mutant.home}): {mutant.description}")
    try:
        print(mutant.patch.diff(), end="")
    except StalePatch as exc:
        print(exc)
        return 1
    return 0


def pytest_command(target: Target, junit: Path, args, seed: int, only: str | None = None) -> list[str]:
    tests = [only] if only else target.dirs
    command = [sys.executable, "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    command += ["--dcp-impl", target.spec, "--dcp-timeout", f"{args.dcp_timeout:g}", "--dcp-seed", str(seed)]
    if target.is_mutant:
        command.append("-x")  # the first failure kills it; the clean port runs every test
    if args.world_sizes:
        command += ["--world-sizes", args.world_sizes]
    return command


def run_target(target: Target, workdir: Path, args, seed: int, only: str | None = None) -> Run:
    """One pytest process: every test of the target's stage order, or ``only`` that node id."""
    if target.stale:
        return Run(target, None, 0.0, seed)
    junit = workdir / f"{target.name}-seed{seed}{'-first' if only else ''}.xml"
    # The report checks every stage: an inherited stage limit would skip tests.
    env = {key: value for key, value in os.environ.items() if key != STAGE_ENV}
    start = time.perf_counter()
    # A session of its own: at the limit one killpg ends pytest and everything it started.
    process = subprocess.Popen(
        pytest_command(target, junit, args, seed, only),
        cwd=ROOT,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = process.communicate(timeout=args.limit)
        returncode = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        returncode = None
    run = Run(target, returncode, time.perf_counter() - start, seed, output[-4000:])
    if junit.exists():
        run.cases = read_junit(junit)
    return run


def run_seeds(target: Target, workdir: Path, args) -> list[Run]:
    """A mutant's runs, seed by seed. From the second seed on, the test that
    killed it at an earlier seed runs alone first (mutmut's order, the last
    killer first): its failure is a kill at that seed; when it passes, the
    whole stage order runs."""
    runs: list[Run] = []
    killer = None
    for seed in args.seeds:
        first = run_target(target, workdir, args, seed, only=killer) if killer else None
        run = first if first is not None and first.killer is not None else run_target(target, workdir, args, seed)
        if first is not None and run is not first:
            run.seconds += first.seconds
        runs.append(run)
        killer = killer or (run.killer.nodeid if run.killer else None)
    return runs


def _nodeid(classname: str, name: str) -> str:
    """JUnit ``tests.stage1_index.test_partition`` + ``test_x[W2]`` -> a pytest node id."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (ROOT / path).is_file():
            return "::".join([path, *parts[cut:], name])
    return f"{classname}::{name}"


# The telling line of a failure, best first: a rank's exception, why ranks did
# not finish, any exception; else the first line.
REASON_PATTERNS = (
    r"^\[rank \d+\] \w+(Error|Exception)\b",
    r"did not finish|dead ranks|still running",
    r"\w+(Error|Exception)\b",
)


def _reason(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for pattern in REASON_PATTERNS:
        for line in lines:
            if re.search(pattern, line):
                return line[:240]
    return (lines[0] if lines else "")[:240]


def read_junit(path: Path) -> list[TestCase]:
    cases = []
    for element in ET.parse(path).getroot().iter("testcase"):
        properties = {p.get("name"): p.get("value") for p in element.iter("property")}
        stage = int(properties[STAGE]) if STAGE in properties else None
        outcome, reason = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            found = element.find(tag)
            if found is not None:
                # The element text holds the whole report; the message attribute is cut.
                outcome, reason = name, _reason(found.text or found.get("message") or "")
                break
        cases.append(TestCase(_nodeid(element.get("classname", ""), element.get("name", "")), stage, outcome, reason))
    return cases


def stage_cell(outcome: Outcome, stage: int) -> str:
    """KILLED: a test of this stage killed the mutant; pass: this stage's tests
    ran and passed; skip: they all skipped; -: none ran (stopped before).
    Of several seeds, the deciding run's."""
    run = outcome.deciding
    if run.killer is not None and run.killer.stage == stage:
        return "KILLED"
    outcomes = {case.outcome for case in run.cases if case.stage == stage}
    if outcomes & {"failed", "error"}:
        return "FAILED"
    if "passed" in outcomes:
        return "pass"
    return "skip" if outcomes else "-"


HEADER = ["mutant", "stage", *STAGE_COLUMNS.values(), "verdict", "s", "killed by / why"]


def matrix_rows(runs: list[Outcome], limit: float) -> list[list[str]]:
    return [
        [
            run.target.name,
            "-" if run.target.stage is None else str(run.target.stage),
            *(stage_cell(run, stage) for stage in STAGE_COLUMNS),
            run.verdict,
            f"{run.seconds:.0f}",
            run.explain(limit),
        ]
        for run in runs
    ]


def format_text(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [HEADER, *rows]) for i in range(len(HEADER) - 1)]

    def line(row: list[str]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1]

    return [line(HEADER), line(["-" * width for width in widths] + ["-" * 15]), *map(line, rows)]


def format_markdown(rows: list[list[str]], descriptions: dict[str, str], totals: list[str]) -> str:
    header = [*HEADER[:-1], "bug", HEADER[-1]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [*row[:-1], descriptions.get(row[0], ""), f"`{row[-1]}`"]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join([*lines, "", *(f"- {line}" for line in totals)]) + "\n"


def summary(mutant_runs: list[Outcome], clean: Outcome, seconds: float, limit: float) -> list[str]:
    def named(verdict: str) -> list[str]:
        return [run.target.name for run in mutant_runs if run.verdict == verdict]

    killed = len(named("killed")) + len(named("killed*"))
    total = len(mutant_runs)
    lines = [f"kill rate: {killed}/{total} = {100.0 * killed / max(total, 1):.1f}%"]
    for verdict, meaning in (
        ("survived", "survived (a hole in the suite)"),
        ("broken", "broken (not killed by a failed test)"),
        ("killed*", "killed* (only by another stage's tests: a hole in its own stage)"),
    ):
        if named(verdict):
            lines.append(f"{meaning}: {', '.join(named(verdict))}")
    lines.append(f"clean port: {clean.verdict} ({clean.explain(limit)}; {clean.seconds:.0f} s over its runs)")
    lines.append(f"wall time: {seconds:.0f} s")
    return lines


FIELD_HEADER = ["#", "report", "field bug", "mutants / why not"]


def field_rows(outcomes: dict[str, Outcome]) -> list[list[str]]:
    """One row per report of docs/field-bugs.md: caught (every mutant carrying
    its root cause killed), survived, broken, not run, or not expressible."""
    from dcpcheck.mutants.field import EQUIVALENT_PATCHES
    from dcpcheck.mutants.field_table import field_reports

    rows = []
    for report in field_reports():
        verdicts = {name: outcomes[name].verdict if name in outcomes else "not run" for name in report.mutants}
        if not verdicts:
            reasons = [f"{name}: {EQUIVALENT_PATCHES[name]}" for name in report.equivalent] or [report.reason]
            rows.append([str(report.number), report.link, "not expressible", "; ".join(reasons)])
            continue
        missed = [verdict for verdict in ("survived", "broken", "not run") if verdict in verdicts.values()]
        status = missed[0] if missed else "caught"
        named = [f"{name} {verdict}" for name, verdict in verdicts.items()]
        named += [f"{name} equivalent" for name in report.equivalent]
        rows.append([str(report.number), report.link, status, ", ".join(named)])
    return rows


def field_summary(rows: list[list[str]]) -> str:
    counts = {status: sum(row[2] == status for row in rows) for status in dict.fromkeys(row[2] for row in rows)}
    return f"field bugs: {len(rows)} reports: " + ", ".join(f"{n} {status}" for status, n in counts.items())


def format_field_text(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [FIELD_HEADER, *rows]) for i in range(3)]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3]
        for row in [FIELD_HEADER, *rows]
    ]


def format_field_markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(FIELD_HEADER) + " |", "|" + "---|" * len(FIELD_HEADER)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this mutant (repeatable, or comma-separated)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="pytest processes at once (default 1)")
    parser.add_argument("--world-sizes", help="passed to pytest (default: pytest's, 1,2,4 on CPU)")
    parser.add_argument(
        "--dcp-timeout", type=float, default=15.0, help="seconds one multi-rank case may take (default 15)"
    )
    parser.add_argument(
        "--limit", type=float, default=300.0, help="wall-clock seconds per pytest process (default 300)"
    )
    parser.add_argument(
        "--seeds",
        default="0",
        help="comma-separated --dcp-seed values; a mutant is killed only if every seed kills it (default 0)",
    )
    parser.add_argument("--markdown", type=Path, help="also write the matrix as markdown to this path")
    parser.add_argument("--list", action="store_true", help="print the catalog and exit")
    parser.add_argument("--show", metavar="NAME", help="print the mutant's diff of the port and exit")
    args = parser.parse_args(argv)
    args.only = [name for value in args.only for name in value.split(",") if name]
    try:
        args.seeds = [int(seed) for seed in args.seeds.split(",") if seed.strip()]
    except ValueError:
        parser.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    if not args.seeds:
        parser.error("--seeds: expected at least one seed")
    if args.jobs < 1:
        parser.error("--jobs: expected at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.show:
        return show(args.show)
    targets = load_targets(args.only)
    if args.list:
        for target in targets:
            stale = f"  [{target.stale}]" if target.stale else ""
            print(f"{target.name:<28} stage {target.stage}  {target.where:<34} {target.description}{stale}")
        return 0
    clean = Target("clean-port", CLEAN_SPEC, None, None, "the embedded port, unmutated")
    start = time.perf_counter()
    runs: dict[str, list[Run]] = {}
    with tempfile.TemporaryDirectory(prefix="mutation-report-") as workdir, ThreadPoolExecutor(args.jobs) as pool:
        # The clean port runs every test at every seed, the longest runs: they start first.
        futures = [pool.submit(lambda seed=seed: [run_target(clean, Path(workdir), args, seed)]) for seed in args.seeds]
        futures += [pool.submit(run_seeds, target, Path(workdir), args) for target in targets]
        for done, future in enumerate(as_completed(futures), 1):
            seeded = future.result()
            runs.setdefault(seeded[0].target.name, []).extend(seeded)
            times = ", ".join(f"seed {run.seed}: {run.verdict} in {run.seconds:.0f} s" for run in seeded)
            print(f"[{done}/{len(futures)}] {seeded[0].target.name} {times}", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - start

    outcomes = {name: Outcome(sorted(seeded, key=lambda run: run.seed)) for name, seeded in runs.items()}
    mutant_runs, clean_run = [outcomes[target.name] for target in targets], outcomes[clean.name]
    rows = matrix_rows(mutant_runs, args.limit)
    totals = summary(mutant_runs, clean_run, seconds, args.limit)
    fields = field_rows({name: outcome for name, outcome in outcomes.items() if name != clean.name})
    totals.insert(-2, field_summary(fields))
    print("\n".join([*format_text(rows), "", *format_field_text(fields), "", *totals]))
    if clean_run.returncode != 0:
        print(f"\nclean port output (tail):\n{clean_run.deciding.output_tail}")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        matrix = format_markdown(rows, {t.name: t.description for t in targets}, totals)
        args.markdown.write_text(f"{matrix}\n## Field bugs\n\n{format_field_markdown(fields)}")
    all_killed = all(run.verdict in KILLS for run in mutant_runs)
    return 0 if all_killed and clean_run.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
