"""Diff coverage of the real DCP2 port: which lines the port's diff adds or
changes does the ``--dcp-impl dsv41`` run execute, per stage folder?

The diff is that of the tree's ``flashinfer_sparse.py`` against the vLLM the
tree mirrors (its other files link to it), so a scratch tree built from
another diff is measured against its own changes. Only statements count
(comments, blank lines and docstrings do not; a changed continuation line
counts as its statement). Statements inside a function are attributed to the
stage folder of the test whose case ran them (the ranks record under the
case's node id: :mod:`dcpcheck.coverage_context`); statements outside any
function run when the module is executed and are counted once. Each line not
run gets the reason of ``REASONS`` that matches it, or shows as unexplained.

    # measure (pytest's arguments after --; exit status: pytest's), then report
    tools/diff_coverage.py run --data build/diffcov -- --dcp-impl dsv41 tests/stage1_index
    tools/diff_coverage.py report --data build/diffcov --markdown reports/dsv41_diff_coverage.md

Measurement is restricted to the tree's file (no line is recorded anywhere
else; Python 3.11's tracer still sees every call, the Triton interpreter's
included, so a measured run takes up to about twice as long); the zygote (a
subprocess), the ranks (its forks) and their ``os._exit`` are covered by
coverage.py's ``patch`` settings.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from cli_arguments import OneLineParser, file_problem, folder_problem  # tools/, beside this file

PORT_FILE = "vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py"
STAGES = ("stage1_index", "stage3_combine", "stage9_prefill", "e2e")
STAGE_OF_CONTEXT = re.compile(r"tests[/.](" + "|".join(STAGES) + r")[/.]")
MODULE_LEVEL = "module level (run on import)"
RUNS_FILE = "runs.txt"
NO_COVERAGE = "coverage.py is not installed: pip install -e '.[coverage]'"

# Why a line cannot run on this machine, first match wins: (function or "",
# regular expression on the line's code, reason). A line matching none is
# "unexplained": either a test is missing or a reason is.
REASONS: tuple[tuple[str, str, str], ...] = (
    (
        "_run_sm120_dcp",
        r"\bev\[|torch\.cuda\.Event|elapsed_time|\bacc\b|acc\[|_dsv41_prefill_acc_add|logger\.info\(|^if prefill_timing:",
        "timing diagnostics: CUDA events (DSV41_DCP_TIMING=1 or the DCP2 stack's prefill timing)",
    ),
    (
        "_run_sm120_dcp",
        r"logger\.info_once|\"DCP path active|capturing,$",
        "timing diagnostics: DSV41_DCP_TIMING=1 log",
    ),
    (
        "_run_sm120_dcp",
        r"cp_lse_ag_out_rs|ctx=self\._cp_ctx",
        "ag_rs combine: vLLM's cp_lse_ag_out_rs cannot run under the Triton interpreter (a GPU runs it)",
    ),
    (
        "",
        r"raise RuntimeError\(|\"FLASHINFER_MLA_SPARSE_DSV4 on SM120",
        "a FlashInfer build without the SM120 DSV4 specialization",
    ),
)


class UsageError(Exception):
    """A bad argument, found where it is used: main prints it as one line and exits 2."""


def argument_problem(args) -> str | None:
    """What is wrong with the arguments, checked before pytest runs or a report is read, else None."""
    if importlib.util.find_spec("coverage") is None:
        return NO_COVERAGE
    if problem := folder_problem(args.data):
        return f"--data {args.data}: {problem}; accepted: a folder that exists or can be made"
    if args.markdown is not None and (problem := file_problem(args.markdown)):
        return f"--markdown {args.markdown}: {problem}; accepted: a file whose folder exists or can be made"
    return None


@dataclass(frozen=True)
class Line:
    number: int
    code: str
    function: str  # the innermost function holding it, "" at module level


def tree_and_stock(tree: Path) -> tuple[Path, Path]:
    """The tree's port file and the vLLM file it was made from."""
    port = tree / PORT_FILE
    if not port.is_file():
        raise UsageError(f"--tree {tree}: no {PORT_FILE} under it (build one with tools/build_dsv41_tree.sh)")
    stock_root = (tree / "vllm" / "__init__.py").resolve().parent  # the tree links every other file to its vLLM
    stock = stock_root / Path(PORT_FILE).relative_to("vllm")
    if not stock.is_file() or stock.resolve() == port.resolve():
        raise UsageError(f"--tree {tree}: its vllm/ does not link to an installed vLLM with {PORT_FILE}")
    return port, stock


def changed_lines(port: Path, stock: Path) -> set[int]:
    """Line numbers of ``port`` that the diff adds or replaces."""
    new = port.read_text().splitlines()
    matcher = difflib.SequenceMatcher(a=stock.read_text().splitlines(), b=new, autojunk=False)
    return {j + 1 for tag, _, _, j1, j2 in matcher.get_opcodes() if tag in ("replace", "insert") for j in range(j1, j2)}


def functions_by_line(source: str) -> dict[int, str]:
    """Each line inside a function body -> the innermost function's name."""
    owner: dict[int, str] = {}
    nodes = sorted(
        (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)),
        key=lambda n: n.lineno,
    )
    for node in nodes:  # outer functions first, so inner ones overwrite their lines
        for number in range(node.body[0].lineno, node.end_lineno + 1):
            owner[number] = node.name
    return owner


def diff_statements(port: Path, stock: Path) -> list[Line]:
    """The statements the diff adds or changes (a changed continuation line counts as its statement)."""
    from coverage.python import PythonParser

    source = port.read_text()
    parser = PythonParser(text=source, filename=str(port))
    parser.parse_source()
    statements = parser.statements
    firsts = {parser.first_line(n) for n in changed_lines(port, stock)} & statements
    owner = functions_by_line(source)
    text = source.splitlines()
    return [Line(n, text[n - 1].strip(), owner.get(n, "")) for n in sorted(firsts)]


def reason_for(line: Line) -> str:
    for function, pattern, reason in REASONS:
        if (not function or function == line.function) and re.search(pattern, line.code):
            return reason
    return "UNEXPLAINED"


def rcfile(data: Path, port: Path) -> Path:
    path = data / "coveragerc"
    path.write_text(
        "[run]\n"
        f"data_file = {data / '.coverage'}\n"
        "parallel = True\n"
        f"include = {port.resolve()}\n"
        "patch =\n    subprocess\n    fork\n    _exit\n"
    )
    return path


def run(args) -> int:
    port, _ = tree_and_stock(args.tree)
    args.data.mkdir(parents=True, exist_ok=True)
    config = rcfile(args.data, port)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(args.tree), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "coverage", "run", f"--rcfile={config}", "-m", "pytest"]
    command += ["-p", "dcpcheck.coverage_context", *args.pytest_args]
    status = subprocess.call(command, env=env)
    with open(args.data / RUNS_FILE, "a") as runs:  # the report says what was measured
        runs.write(f"pytest {' '.join(args.pytest_args)} (exit {status})\n")
    if args.markdown:
        report(args)
    return status


def executed_by_stage(data_dir: Path, port: Path) -> dict[int, set[str]]:
    """Line -> the stage folders (or MODULE_LEVEL's "") whose tests ran it."""
    from coverage import CoverageData

    parts = sorted(data_dir.glob(".coverage.*"))  # one file per measured process
    if not parts:
        raise UsageError(
            f"--data {data_dir}: no coverage data (measure first: tools/diff_coverage.py run --data {data_dir} -- ...)"
        )
    stages: dict[int, set[str]] = {}
    target = str(port.resolve())
    for name in parts:
        part = CoverageData(basename=str(name))
        part.read()
        for measured in part.measured_files():
            if os.path.realpath(measured) != target:
                continue
            for number, contexts in part.contexts_by_lineno(measured).items():
                for context in contexts:
                    match = STAGE_OF_CONTEXT.search(context)
                    stages.setdefault(number, set()).add(match.group(1) if match else "")
    return stages


def runs_of(data_dir: Path) -> list[str]:
    path = data_dir / RUNS_FILE
    return path.read_text().splitlines() if path.is_file() else ["(not recorded)"]


def report(args) -> None:
    port, stock = tree_and_stock(args.tree)
    lines = diff_statements(port, stock)
    ran = executed_by_stage(args.data, port)
    in_functions = [line for line in lines if line.function]
    module_level = [line for line in lines if not line.function]
    out = [
        f"# Diff coverage of the DCP2 port: `{PORT_FILE}`",
        "",
        f"Written by `tools/diff_coverage.py` from `{args.tree}` against the vLLM it links to: "
        f"{len(lines)} statements added or changed by the diff, {len(in_functions)} of them inside functions.",
        "",
        "Measured runs:",
        "",
        *[f"    {line}" for line in runs_of(args.data)],
        "",
        "| stage folder | statements in functions run | of | % |",
        "|---|---|---|---|",
    ]
    for stage in (*STAGES, "all"):
        hit = [line for line in in_functions if line.number in ran and (stage == "all" or stage in ran[line.number])]
        out.append(f"| {stage} | {len(hit)} | {len(in_functions)} | {100 * len(hit) / max(1, len(in_functions)):.0f} |")
    run_module = sum(line.number in ran for line in module_level)
    out += ["", f"{MODULE_LEVEL}: {run_module} of {len(module_level)} run.", "", "## Not run", ""]
    missing = [line for line in lines if line.number not in ran]
    out += ["| line | function | code | reason |", "|---|---|---|---|"]
    out += [f"| {line.number} | {line.function or '-'} | `{line.code}` | {reason_for(line)} |" for line in missing]
    unexplained = sum(reason_for(line) == "UNEXPLAINED" for line in missing)
    out += ["", f"{len(missing)} not run, {unexplained} of them unexplained."]
    text = "\n".join(out) + "\n"
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
    print(text)


def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "report"):
        command = sub.add_parser(name)
        command.add_argument(
            "--tree", type=Path, default=Path("build/dsv41-tree"), help="the DCP2 tree (default: build/dsv41-tree)"
        )
        command.add_argument("--data", type=Path, required=True, help="folder of the coverage data (runs add to it)")
        command.add_argument("--markdown", type=Path, help="write the report here too (run: after pytest)")
    sub.choices["run"].add_argument("pytest_args", nargs=argparse.REMAINDER, help="-- then pytest's arguments")
    args = parser.parse_args(argv)
    if problem := argument_problem(args):
        parser.error(problem)
    try:
        if args.command == "report":
            report(args)
            return 0
        if args.pytest_args[:1] == ["--"]:
            args.pytest_args = args.pytest_args[1:]
        if not args.pytest_args:
            parser.error("run: give pytest's arguments after --, e.g. -- --dcp-impl dsv41 tests/stage1_index")
        return run(args)
    except UsageError as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
