"""The GPU CI's sessions read back (``tools/gpu_ci.py``): their JUnit files
into summary rows (step x stage x W x backend x ranks) and per-step phases,
the cases a ``--session-timeout`` cut, and whether a session's per-phase
breakdown is missing."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from gpu_ci_launch import SessionRun
from gpu_ci_plugin import XPASS_NODEID, XPASS_REASON
from gpu_ci_sessions import Session
from session_cut import cut_cases, cut_row_key

from dcpcheck.plugin import junit_properties as prop


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
        return self.seconds - self.totals["pool_start_s"] - self.totals["compile_s"] - self.totals["gpu_ledger_wait_s"]


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
