"""Diff coverage of the real DCP2 port: which lines that the port's diff adds
or changes does the ``--dcp-impl dsv41`` run execute, per changed file and
stage folder?

The diff is that of every ``.py`` file of the tree that is a real file (not a
link to the vLLM the tree mirrors) and differs from its counterpart there, or
that vLLM lacks (a file the diff adds), so a scratch tree built from any diff
is measured against its own changes. Lines from ``tools/build_dsv41_tree.sh``'s
marker on (its no-op timing stand-ins) are the build script's, not the diff's,
and do not count. Only statements count (comments, blank lines and docstrings
do not; a changed continuation line counts as its statement). Statements
inside a function are attributed to the stage folder of the test whose case
ran them (the ranks record under the case's node id:
:mod:`dcpcheck.coverage_context`); statements outside any function run when
the module is executed and are counted once. Each line not run gets the
reason of ``REASONS`` that matches it, or shows as unexplained.

    # measure (pytest's arguments after --; exit status: pytest's), then report
    tools/diff_coverage.py run --data build/diffcov -- --dcp-impl dsv41 tests/stage1_index
    tools/diff_coverage.py report --data build/diffcov --markdown reports/dsv41_diff_coverage.md

Measurement is restricted to the tree's changed files (no line is recorded
anywhere else; Python 3.11's tracer still sees every call, the Triton
interpreter's included, so a measured run takes up to about twice as long);
the zygote (a subprocess), the ranks (its forks) and their ``os._exit`` are
covered by coverage.py's ``patch`` settings.
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
import tokenize
from dataclasses import dataclass
from pathlib import Path

from cli_arguments import OneLineParser, file_problem, folder_problem  # tools/, beside this file

PORT_FILE = "vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py"
STAGES = ("stage1_index", "stage3_combine", "stage9_prefill", "e2e")
STAGE_OF_CONTEXT = re.compile(r"tests[/.](" + "|".join(STAGES) + r")[/.]")
MODULE_LEVEL = "module level (run on import)"
RUNS_FILE = "runs.txt"
NO_COVERAGE = "coverage.py is not installed: pip install -e '.[coverage]'"
# tools/build_dsv41_tree.sh appends its no-op timing stand-ins after this line (dcpcheck's
# stand_ins.TIMING_MARKER; not imported from there: that package imports torch).
BUILD_MARKER = "# ---- dcpcheck: no-op stand-ins"

# Why a line cannot run on this machine, first match wins: (file in the tree or "" for any,
# function or "", regular expression on the line's code, reason). A line matching none is
# "unexplained": either a test is missing or a reason is.
REASONS: tuple[tuple[str, str, str, str], ...] = (
    (
        PORT_FILE,
        "_run_sm120_dcp",
        r"\bev\[|torch\.cuda\.Event|elapsed_time|\bacc\b|acc\[|_dsv41_prefill_acc_add|logger\.info\(|^if prefill_timing:",
        "timing diagnostics: CUDA events (DSV41_DCP_TIMING=1 or the DCP2 stack's prefill timing)",
    ),
    (
        PORT_FILE,
        "_run_sm120_dcp",
        r"logger\.info_once|\"DCP path active|capturing,$",
        "timing diagnostics: DSV41_DCP_TIMING=1 log",
    ),
    (
        PORT_FILE,
        "_run_sm120_dcp",
        r"cp_lse_ag_out_rs|ctx=self\._cp_ctx",
        "ag_rs combine: vLLM's cp_lse_ag_out_rs cannot run under the Triton interpreter (a GPU runs it)",
    ),
    (
        PORT_FILE,
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
class ChangedFile:
    path: str  # in the tree: vllm/...
    own: Path  # the tree's file
    stock: Path | None  # the vLLM file it was made from; None: a file the diff adds


@dataclass(frozen=True)
class Line:
    path: str  # its file's, in the tree
    number: int
    code: str
    function: str  # the innermost function holding it, "" at module level


def stock_root(tree: Path) -> Path:
    """The installed vllm/ folder the tree's links point into."""
    vllm = tree / "vllm"
    link = next((path for path in vllm.rglob("*.py") if path.is_symlink()), None) if vllm.is_dir() else None
    if link is None:
        raise UsageError(
            f"--tree {tree}: no vllm/ of links to an installed vLLM (build one with tools/build_dsv41_tree.sh)"
        )
    root = link.resolve()
    for _ in link.relative_to(vllm).parts:
        root = root.parent
    return root


def changed_files(tree: Path) -> list[ChangedFile]:
    """The tree's real .py files that differ from the vLLM it links to, or that it lacks."""
    stock = stock_root(tree)
    changed = []
    for own in sorted(path for path in (tree / "vllm").rglob("*.py") if path.is_file() and not path.is_symlink()):
        counterpart = stock / own.relative_to(tree / "vllm")
        if not counterpart.is_file():
            changed.append(ChangedFile(own.relative_to(tree).as_posix(), own, None))
        elif counterpart.read_bytes() != own.read_bytes():
            changed.append(ChangedFile(own.relative_to(tree).as_posix(), own, counterpart))
    if not changed:
        raise UsageError(f"--tree {tree}: no .py file of it differs from the vLLM it links to ({stock})")
    for file in changed:  # its statements are found by parsing it: refused before pytest runs, not after
        if problem := parse_problem(file.own):
            raise UsageError(
                f"--tree {tree}: {file.path} does not parse ({problem}); accepted: changed files of Python"
            )
    return changed


def parse_problem(path: Path) -> str | None:
    """Why ``path`` is not Python that parses, else None."""
    try:
        ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as exc:
        return f"line {exc.lineno}: {exc.msg}"
    except ValueError as exc:  # null bytes, on Python 3.11
        return str(exc)
    return None


def python_source(path: Path) -> str:
    """The file's text in the encoding it declares (PEP 263; UTF-8 if none), as Python reads it."""
    try:
        with tokenize.open(path) as source:
            return source.read()
    except (SyntaxError, UnicodeDecodeError) as exc:  # an unknown encoding, bytes not of the declared one
        raise UsageError(
            f"{path}: not Python source in its declared encoding ({exc}); accepted: Python files in the encoding they declare, UTF-8 if none"
        ) from None


def changed_lines(changed: ChangedFile) -> set[int]:
    """Line numbers of the tree's file that the diff adds or replaces (not the build script's stand-ins)."""
    new = python_source(changed.own).splitlines()
    old = python_source(changed.stock).splitlines() if changed.stock else []
    build_part = next((n for n, line in enumerate(new, 1) if line.startswith(BUILD_MARKER)), len(new) + 1)
    matcher = difflib.SequenceMatcher(a=old, b=new, autojunk=False)
    lines = {
        j + 1 for tag, _, _, j1, j2 in matcher.get_opcodes() if tag in ("replace", "insert") for j in range(j1, j2)
    }
    return {number for number in lines if number < build_part}


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


def diff_statements(changed: ChangedFile) -> list[Line]:
    """The statements the diff adds or changes (a changed continuation line counts as its statement)."""
    from coverage.python import PythonParser

    source = python_source(changed.own)
    parser = PythonParser(text=source, filename=str(changed.own))
    parser.parse_source()
    firsts = {parser.first_line(n) for n in changed_lines(changed)} & parser.statements
    owner = functions_by_line(source)
    text = source.splitlines()
    return [Line(changed.path, n, text[n - 1].strip(), owner.get(n, "")) for n in sorted(firsts)]


def reason_for(line: Line) -> str:
    for path, function, pattern, reason in REASONS:
        if path in ("", line.path) and function in ("", line.function) and re.search(pattern, line.code):
            return reason
    return "UNEXPLAINED"


def rcfile(data: Path, files: list[ChangedFile]) -> Path:
    path = data / "coveragerc"
    path.write_text(
        "[run]\n"
        f"data_file = {data / '.coverage'}\n"
        "parallel = True\n"
        "include =\n"
        + "".join(f"    {changed.own.resolve()}\n" for changed in files)
        + "patch =\n    subprocess\n    fork\n    _exit\n"
    )
    return path


def run(args) -> int:
    files = changed_files(args.tree)
    args.data.mkdir(parents=True, exist_ok=True)
    config = rcfile(args.data, files)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(args.tree), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "coverage", "run", f"--rcfile={config}", "-m", "pytest"]
    command += ["-p", "dcpcheck.coverage_context", *args.pytest_args]
    status = subprocess.call(command, env=env)
    with open(args.data / RUNS_FILE, "a") as runs:  # the report says what was measured
        runs.write(f"pytest {' '.join(args.pytest_args)} (exit {status})\n")
    if args.markdown:
        report(args)
    return status


def executed_by_stage(data_dir: Path, files: list[Path]) -> dict[str, dict[int, set[str]]]:
    """Each file (by its real path) -> line -> the stage folders (or MODULE_LEVEL's "") whose tests ran it."""
    from coverage import CoverageData

    parts = sorted(data_dir.glob(".coverage.*"))  # one file per measured process
    if not parts:
        raise UsageError(
            f"--data {data_dir}: no coverage data (measure first: tools/diff_coverage.py run --data {data_dir} -- ...)"
        )
    ran: dict[str, dict[int, set[str]]] = {str(path.resolve()): {} for path in files}
    for name in parts:
        part = CoverageData(basename=str(name))
        part.read()
        for measured in part.measured_files():
            stages = ran.get(os.path.realpath(measured))
            if stages is None:
                continue
            for number, contexts in part.contexts_by_lineno(measured).items():
                for context in contexts:
                    match = STAGE_OF_CONTEXT.search(context)
                    stages.setdefault(number, set()).add(match.group(1) if match else "")
    return ran


def runs_of(data_dir: Path) -> list[str]:
    path = data_dir / RUNS_FILE
    return path.read_text().splitlines() if path.is_file() else ["(not recorded)"]


def percent(hit: int, of: int) -> str:
    return f"{100 * hit / of:.0f}" if of else "-"


def partition(lines: list[Line], ran: dict[int, set[str]]) -> tuple[list[Line], list[Line], list[Line]]:
    """(the statements inside functions, those at module level, those not run)."""
    in_functions = [line for line in lines if line.function]
    module_level = [line for line in lines if not line.function]
    return in_functions, module_level, [line for line in lines if line.number not in ran]


def summary_row(name: str, lines: list[Line], ran: dict[int, set[str]]) -> str:
    """One file's line of the summary: statements in functions run, module-level run, not run, unexplained."""
    in_functions, module_level, missing = partition(lines, ran)
    run_in_functions = sum(line.number in ran for line in in_functions)
    cells = [run_in_functions, len(in_functions), percent(run_in_functions, len(in_functions))]
    cells += [sum(line.number in ran for line in module_level), len(module_level), len(missing)]
    cells.append(sum(reason_for(line) == "UNEXPLAINED" for line in missing))
    return f"| {name} | " + " | ".join(map(str, cells)) + " |"


def file_section(path: str, lines: list[Line], ran: dict[int, set[str]]) -> list[str]:
    """One file's stage table, module-level count and the lines not run with their reasons."""
    in_functions, module_level, missing = partition(lines, ran)
    out = [f"## `{path}`", "", "| stage folder | statements in functions run | of | % |", "|---|---|---|---|"]
    for stage in (*STAGES, "all"):
        hit = [line for line in in_functions if line.number in ran and (stage == "all" or stage in ran[line.number])]
        out.append(f"| {stage} | {len(hit)} | {len(in_functions)} | {percent(len(hit), len(in_functions))} |")
    run_module = sum(line.number in ran for line in module_level)
    out += ["", f"{MODULE_LEVEL}: {run_module} of {len(module_level)} run.", ""]
    if missing:
        out += ["| line | function | code | reason |", "|---|---|---|---|"]
        out += [f"| {line.number} | {line.function or '-'} | `{line.code}` | {reason_for(line)} |" for line in missing]
        out.append("")
    unexplained = sum(reason_for(line) == "UNEXPLAINED" for line in missing)
    return [*out, f"{len(missing)} not run, {unexplained} of them unexplained.", ""]


def header(tree: Path, statements: dict[str, list[Line]]) -> list[str]:
    """The report's opening: what was compared, and the changed files without a statement to count."""
    total = sum(map(len, statements.values()))
    out = [
        "# Diff coverage of the DCP2 port",
        "",
        f"Written by `tools/diff_coverage.py` from `{tree}` against the vLLM it links to: {len(statements)} files "
        f"changed, {total} statements added or changed by the diff (the build script's no-op timing stand-ins "
        "after its marker do not count).",
        "",
    ]
    uncounted = ", ".join(f"`{path}`" for path, lines in statements.items() if not lines)
    if uncounted:
        out += [f"Changed without a statement to count (comments, removed lines, the stand-ins): {uncounted}.", ""]
    return out


def report(args) -> None:
    files = changed_files(args.tree)
    statements = {changed.path: diff_statements(changed) for changed in files}
    ran_by_file = executed_by_stage(args.data, [changed.own for changed in files])
    ran = {changed.path: ran_by_file[str(changed.own.resolve())] for changed in files}
    counted = {path: lines for path, lines in statements.items() if lines}
    out = [
        *header(args.tree, statements),
        "Measured runs:",
        "",
        *[f"    {line}" for line in runs_of(args.data)],
        "",
        "| file | statements in functions run | of | % | module level run | of | not run | unexplained |",
        "|---|---|---|---|---|---|---|---|",
        *[summary_row(f"`{path}`", lines, ran[path]) for path, lines in counted.items()],
        "",
    ]
    for path, lines in counted.items():
        out += file_section(path, lines, ran[path])
    text = "\n".join(out)
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
