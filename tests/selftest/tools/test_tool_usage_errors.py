"""Every bad argument of ``tools/gpu_ci.py`` and ``tools/diff_coverage.py`` is
a usage error, as the plugin's are: exit 2, one line saying what was wrong and
what is accepted, no traceback, and nothing run (no session, no measurement)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.selftest.support.inner import REPO_ROOT, inner_env

TOOL_CALLS = Path(__file__).parents[1] / "support" / "tool_calls.py"

# Were an argument accepted, the session it starts stays small: stage 1 at
# W = 1 without xdist, every case deselected.
GPU_CI_SMALL_RUN = ("--device", "cpu", "--steps", "stage1", "--workers", "0", "--world-sizes", "1")
GPU_CI_NO_CASES = ("--", "-k", "no_such_case")
SECONDS = "expected a finite number of seconds above 0 and at most 1e+06"
FOLDER = "accepted: a folder that exists or can be made"
FILE = "accepted: a file whose folder exists or can be made"
NO_COVERAGE = "coverage.py is not installed: pip install -e '.[coverage]'"

# (argv, the one line's message); {file} is an existing file, {folder} an existing folder.
GPU_CI_CASES = [
    (["--out", "{file}"], f"--out {{file}}: {{file}} is a file; {FOLDER}"),
    (["--out", "{file}/sub"], f"--out {{file}}/sub: {{file}} is a file; {FOLDER}"),
    (["--report", "{folder}"], f"--report {{folder}}: {{folder}} is a folder; {FILE}"),
    (["--report", "{file}/summary.md"], f"--report {{file}}/summary.md: {{file}} is a file; {FILE}"),
    (["--session-timeout", "-1"], f"--session-timeout -1: {SECONDS}, e.g. 3600"),
    (["--session-timeout", "0"], f"--session-timeout 0: {SECONDS}, e.g. 3600"),
    (["--session-timeout", "nan"], f"--session-timeout nan: {SECONDS}, e.g. 3600"),
    (["--session-timeout", "inf"], f"--session-timeout inf: {SECONDS}, e.g. 3600"),
    (["--session-timeout", "1e300"], f"--session-timeout 1e+300: {SECONDS}, e.g. 3600"),
    (["--dcp-timeout", "0"], f"--dcp-timeout 0: {SECONDS}, e.g. 60"),
    (["--dcp-timeout", "nan"], f"--dcp-timeout nan: {SECONDS}, e.g. 60"),
    (["--world-sizes", "0,2"], "--world-sizes '0,2': expected comma-separated positive integers, e.g. 1,2,4,8"),
    (["--world-sizes", "two"], "--world-sizes 'two': expected comma-separated positive integers, e.g. 1,2,4,8"),
    (["--workers", "-1"], "--workers -1: accepted: 0 or 1 (no xdist), or more"),
]

# (interpreter flags, argv, the one line's message). ``-S`` leaves out
# site-packages: an interpreter without coverage.py. A ``run`` that got past
# its arguments stops at once at its tree (``--tree {folder}``: no port in it).
DIFF_COVERAGE_CASES = [
    (["-S"], ["report", "--data", "{folder}"], NO_COVERAGE),
    (["-S"], ["run", "--tree", "{folder}", "--data", "{folder}", "--", "tests"], NO_COVERAGE),
    ([], ["report", "--data", "{file}"], f"--data {{file}}: {{file}} is a file; {FOLDER}"),
    (
        [],
        ["run", "--tree", "{folder}", "--data", "{file}/sub", "--", "tests"],
        f"--data {{file}}/sub: {{file}} is a file; {FOLDER}",
    ),
    (
        [],
        ["report", "--data", "{folder}", "--markdown", "{folder}"],
        f"--markdown {{folder}}: {{folder}} is a folder; {FILE}",
    ),
    (
        [],
        ["run", "--tree", "{folder}", "--data", "{folder}", "--markdown", "{file}/report.md", "--", "tests"],
        f"--markdown {{file}}/report.md: {{file}} is a file; {FILE}",
    ),
    (
        [],
        ["report", "--tree", "{folder}", "--data", "{folder}"],
        "--tree {folder}: no vllm/ of links to an installed vLLM (build one with tools/build_dsv41_tree.sh)",
    ),
    (
        [],
        ["report", "--tree", "{broken_tree}", "--data", "{folder}"],
        "--tree {broken_tree}: vllm/broken.py does not parse ({broken_problem}); accepted: changed files of Python",
    ),
]
BROKEN_SOURCE = "def forward(self:\n    return 1\n"


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("places")
    (folder / "a-file").write_text("not a folder\n")
    (folder / "a-folder").mkdir()
    # A tree whose one changed file does not parse, beside a link into a stand-in for the vLLM it mirrors.
    stock, tree = folder / "stock" / "vllm", folder / "broken-tree" / "vllm"
    stock.mkdir(parents=True)
    tree.mkdir(parents=True)
    (stock / "linked.py").write_text("x = 1\n")
    (tree / "linked.py").symlink_to(stock / "linked.py")
    (tree / "broken.py").write_text(BROKEN_SOURCE)
    try:
        compile(BROKEN_SOURCE, "broken.py", "exec")
    except SyntaxError as exc:  # this Python's words for it
        broken_problem = f"line {exc.lineno}: {exc.msg}"
    return {
        "file": str(folder / "a-file"),
        "folder": str(folder / "a-folder"),
        "out": str(folder / "out"),
        "broken_tree": str(tree.parent),
        "broken_problem": broken_problem,
    }


def tool_answers(tool: str, flags: list[str], argvs: list[list[str]]) -> list[dict]:
    """Each argument list's answer from ``tool``, all called in one process (tool_calls.py)."""
    done = subprocess.run(
        [sys.executable, *flags, str(TOOL_CALLS), tool],
        cwd=REPO_ROOT,
        env=inner_env(),
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def gpu_ci_argv(argv: list[str], places: dict[str, str]) -> list[str]:
    return [*GPU_CI_SMALL_RUN, "--out", places["out"], *(arg.format(**places) for arg in argv), *GPU_CI_NO_CASES]


def answers_by_call(tool: str, calls: list[tuple[tuple[str, ...], list[str]]]) -> dict[tuple[str, ...], dict]:
    """Each (interpreter flags, argv) call's answer from ``tool``, keyed ``(*flags, *argv)``: one process per
    set of flags."""
    answers = {}
    for flags in dict.fromkeys(flags for flags, _ in calls):
        argvs = [argv for call_flags, argv in calls if call_flags == flags]
        answers.update({(*flags, *argv): answer for argv, answer in zip(argvs, tool_answers(tool, list(flags), argvs))})
    return answers


@pytest.fixture(scope="module")
def gpu_ci_answers(places) -> dict[tuple[str, ...], dict]:
    return answers_by_call("tools/gpu_ci.py", [((), gpu_ci_argv(argv, places)) for argv, _ in GPU_CI_CASES])


@pytest.fixture(scope="module")
def diff_coverage_answers(places) -> dict[tuple[str, ...], dict]:
    calls = [(tuple(flags), [arg.format(**places) for arg in argv]) for flags, argv, _ in DIFF_COVERAGE_CASES]
    return answers_by_call("tools/diff_coverage.py", calls)


def usage_error_line(answer: dict) -> str:
    """The one stderr line of a call that must refuse its arguments with exit 2."""
    assert "Traceback" not in answer["stderr"], answer["stderr"]
    assert answer["status"] == 2, (answer["status"], answer["stdout"][-2000:], answer["stderr"][-2000:])
    lines = answer["stderr"].splitlines()
    assert len(lines) == 1, answer["stderr"]
    return lines[0]


@pytest.mark.parametrize(("argv", "message"), [pytest.param(*case, id=" ".join(case[0])) for case in GPU_CI_CASES])
def test_gpu_ci_refuses_a_bad_argument_in_one_line(argv, message, places, gpu_ci_answers):
    answer = gpu_ci_answers[tuple(gpu_ci_argv(argv, places))]
    assert usage_error_line(answer) == f"gpu_ci.py: error: {message.format(**places)}"
    assert answer["stdout"] == ""  # no session started


@pytest.mark.parametrize(
    ("flags", "argv", "message"), [pytest.param(*case, id=" ".join(case[0] + case[1])) for case in DIFF_COVERAGE_CASES]
)
def test_diff_coverage_refuses_a_bad_argument_in_one_line(flags, argv, message, places, diff_coverage_answers):
    answer = diff_coverage_answers[(*flags, *(arg.format(**places) for arg in argv))]
    # A missing coverage.py is named before any argument: so it is under the README's install (no extras).
    expected = message if importlib.util.find_spec("coverage") is not None else NO_COVERAGE
    assert usage_error_line(answer) == f"diff_coverage.py: error: {expected.format(**places)}"
    assert answer["stdout"] == ""  # nothing measured, no report
