"""``tools/gpu_ci.py --session-timeout`` stopping a session says so: the
driver names the time-out, and the summary counts the cases it cut (those
running when it came) as failed, listing them, instead of pytest's
``KeyboardInterrupt`` and ``exited 2``. Run as the CPU dry run."""

from __future__ import annotations

import json
import signal
import sys
import time

import pytest

from tests.selftest.support.inner import REPO_ROOT, inner_env, write_session

sys.path.insert(0, str(REPO_ROOT / "tools"))

import gpu_ci  # tools/ is on sys.path

ONE_STUCK = """
import time

def test_fine():
    pass

def test_stuck():
    time.sleep(600)
"""


# A run started in the background (CI, nohup) inherits SIGINT ignored; its sessions must still stop.
@pytest.mark.parametrize("sigint", [signal.SIG_DFL, signal.SIG_IGN], ids=["foreground", "background"])
def test_a_session_stopped_by_the_time_out_names_it_and_its_cut_cases(tmp_path, monkeypatch, capsys, sigint):
    repo = tmp_path / "repo"
    (repo / "tests" / "stage1_index").mkdir(parents=True)
    write_session(repo, {})
    (repo / "tests" / "stage1_index" / "test_one_stuck.py").write_text(ONE_STUCK)
    monkeypatch.setattr(gpu_ci, "REPO", repo)
    monkeypatch.setattr(gpu_ci.os, "environ", inner_env())
    out = tmp_path / "out"
    before, started = signal.signal(signal.SIGINT, sigint), time.time()
    try:
        code = gpu_ci.main(
            ["--device", "cpu", "--steps", "stage1", "--workers", "0", "--out", str(out)] + ["--session-timeout", "8"]
        )
    finally:
        signal.signal(signal.SIGINT, before)
    printed = capsys.readouterr().out
    assert "killing it (SIGKILL)" not in printed, printed
    assert code == 1, printed
    assert "=== pool: --session-timeout 8 s reached: stopping it (SIGINT)" in printed, printed
    assert "session pool exited" not in printed, printed
    assert (
        "gpu_ci: session pool: stopped by --session-timeout 8 s (the KeyboardInterrupt above); cases cut: "
        "tests/stage1_index/test_one_stuck.py::test_stuck" in printed
    ), printed
    summary = (out / "summary.md").read_text()
    assert "| stage1 | cut | - | - | - | 1 | 0 | 1 |" in summary, summary
    # The progress file is also the session's timeline: when each case started and ended, and in which process.
    noted = [json.loads(line) for line in (out / "pool.progress").read_text().splitlines()]
    assert [note[0] for note in noted] == ["start", "end", "start"], noted
    assert all(started <= note[2] <= time.time() and isinstance(note[3], int) for note in noted), noted
