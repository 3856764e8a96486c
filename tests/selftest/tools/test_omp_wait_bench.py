"""``tools/omp_wait_bench.py``: its ranks run under each wait policy in turn, alternated, and the report gives
each policy's runs and medians; a bad argument is one line and exit 2, before anything runs."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.selftest.support.inner import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))

import omp_wait_bench  # tools/ is on sys.path


class FinishedRank:
    def wait(self) -> int:
        return 0


def test_each_run_starts_its_ranks_under_its_policy_the_policies_alternated(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's: the default run must not inherit it
    started = []

    def popen(argv, env):
        started.append(env.get("OMP_WAIT_POLICY"))
        return FinishedRank()

    # Replaced under the tool's own name, not in the subprocess module: the rest of this process keeps Popen.
    monkeypatch.setattr(omp_wait_bench, "subprocess", SimpleNamespace(Popen=popen))
    args = omp_wait_bench.parse_args(["--processes", "2", "--threads", "3", "--repeats", "3"])
    runs = omp_wait_bench.measure(args)
    assert started == [
        None,
        None,
        "PASSIVE",
        "PASSIVE",
        "PASSIVE",
        "PASSIVE",
        None,
        None,
        None,
        None,
        "PASSIVE",
        "PASSIVE",
    ]
    assert {policy: len(samples) for policy, samples in runs.items()} == {"default": 3, "PASSIVE": 3}


def test_a_small_run_reports_both_policies(tmp_path):
    report = tmp_path / "sub" / "omp.md"
    tiny = ["--processes", "1", "--steps", "1", "--repeats", "1", "--rows", "1", "--heads", "1", "--dim", "8"]
    argv = [*tiny, "--top-k", "4", "--window", "2", "--gap", "0", "--report", str(report)]
    done = subprocess.run(
        [sys.executable, "tools/omp_wait_bench.py", *argv], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    rows = [line for line in report.read_text().splitlines() if line.startswith(("| default", "| PASSIVE"))]
    assert [row.split(" | ")[0] for row in rows] == ["| default", "| PASSIVE"], report.read_text()
    assert all(float(cell) > 0 for row in rows for cell in row.split(" | ")[1:3]), rows
    assert done.stdout == report.read_text()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--threads", "0"], "--threads 0: accepted: 1 or more"),
        (["--gap", "-1"], "--gap -1.0: accepted: 0 or more"),
        (
            ["--report", "{folder}"],
            "--report {folder}: {folder} is a folder; accepted: a file whose folder exists or can be made",
        ),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_2(tmp_path, argv, message):
    argv = [arg.format(folder=tmp_path) for arg in argv]
    done = subprocess.run(
        [sys.executable, "tools/omp_wait_bench.py", *argv], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"omp_wait_bench.py: error: {message.format(folder=tmp_path)}\n"
