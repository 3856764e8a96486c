"""Every bad argument of ``tools/gpu_ci.py`` and ``tools/diff_coverage.py`` is
a usage error, as the plugin's are: exit 2, one line saying what was wrong and
what is accepted, no traceback, and nothing run (no session, no measurement)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.selftest.inner import REPO_ROOT, inner_env

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
]


@pytest.fixture
def places(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "a-file").write_text("not a folder\n")
    (tmp_path / "a-folder").mkdir()
    return {"file": str(tmp_path / "a-file"), "folder": str(tmp_path / "a-folder")}


def usage_error(command: list[str]) -> tuple[str, str]:
    """(stdout, the one stderr line) of a tool that must refuse its arguments with exit 2."""
    done = subprocess.run(command, cwd=REPO_ROOT, env=inner_env(), capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    return done.stdout, lines[0]


@pytest.mark.parametrize(("argv", "message"), [pytest.param(*case, id=" ".join(case[0])) for case in GPU_CI_CASES])
def test_gpu_ci_refuses_a_bad_argument_in_one_line(argv, message, places, tmp_path):
    command = [sys.executable, "tools/gpu_ci.py", *GPU_CI_SMALL_RUN, "--out", str(tmp_path / "out")]
    stdout, line = usage_error([*command, *(arg.format(**places) for arg in argv), *GPU_CI_NO_CASES])
    assert line == f"gpu_ci.py: error: {message.format(**places)}"
    assert stdout == ""  # no session started


@pytest.mark.parametrize(
    ("flags", "argv", "message"), [pytest.param(*case, id=" ".join(case[0] + case[1])) for case in DIFF_COVERAGE_CASES]
)
def test_diff_coverage_refuses_a_bad_argument_in_one_line(flags, argv, message, places):
    command = [sys.executable, *flags, "tools/diff_coverage.py", *(arg.format(**places) for arg in argv)]
    stdout, line = usage_error(command)
    # A missing coverage.py is named before any argument: so it is under the README's install (no extras).
    expected = message if importlib.util.find_spec("coverage") is not None else NO_COVERAGE
    assert line == f"diff_coverage.py: error: {expected.format(**places)}"
    assert stdout == ""  # nothing measured, no report
