"""``tools/gpu_ci.py``'s summary counts each XPASS (a case whose known defect
did not show) per step, stage and W beside the expected failures, and its run
ends with one line per XPASS naming the case and its defect. pytest writes an
XPASS to JUnit as a plain passed testcase: the sessions load gpu_ci as a
pytest plugin (``-p gpu_ci``), which records it there; this JUnit comes from
a real pytest run so loaded."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from tests.selftest.support.inner import REPO_ROOT, inner_env, run_python_module

sys.path.insert(0, str(REPO_ROOT / "tools"))

import gpu_ci  # tools/ is on sys.path
import gpu_ci_junit
import gpu_ci_launch
import gpu_ci_load

KNOWN_DEFECTS = """
import pytest

@pytest.mark.xfail(reason="known defect: the LSE is off")
def test_still_broken():
    assert False

def test_fixed_since(request):
    request.node.add_marker(pytest.mark.xfail(reason="known defect of mine: stale slot mapping"))

def test_fine():
    pass
"""
XPASS_LINE = (
    "XPASS (a known defect did not show: fixed, or its case missed it): "
    "test_known_defects.py::test_fixed_since — known defect of mine: stale slot mapping"
)


@pytest.fixture(scope="module")
def junit(tmp_path_factory) -> Path:
    """The JUnit XML of a pytest session run as gpu_ci runs its sessions."""
    folder = tmp_path_factory.mktemp("known_defects")
    (folder / "test_known_defects.py").write_text(KNOWN_DEFECTS)
    xml = folder / "pool.xml"
    args = ["-q", "-p", "no:cacheprovider", "-p", gpu_ci.PLUGIN, "--junitxml", str(xml), "test_known_defects.py"]
    run_python_module(folder, "pytest", args, env=gpu_ci.with_plugin_path(inner_env()), timeout=120)
    return xml


def test_an_xpass_has_its_column_beside_the_xfails(junit):
    rows, phases, xfails, xpasses = gpu_ci.summarize({junit: {"stage1": ["test_known_defects.py"]}})
    (row,) = rows.values()
    assert (row.passed, row.failed, row.xfailed, row.xpassed, row.skipped) == (1, 0, 1, 1, 0)
    table = gpu_ci.render(rows, phases, [], ["stage1"], xfails, xpasses).splitlines()
    assert "| failed | xfailed | xpassed | skipped |" in table[0]
    assert table[2].startswith("| stage1 | harness | - | - | - | 3 | 1 | 0 | 1 | 1 | 0 |")


def test_a_per_world_step_gets_its_seconds_and_peak_per_w(junit):
    rows, phases, xfails, xpasses = gpu_ci.summarize({junit: {"production": ["test_known_defects.py"]}})
    table = gpu_ci.render(rows, phases, [], ["production"], xfails, xpasses).splitlines()
    header = table.index("| production: W | cases | case s | peak GPU GiB |")
    assert table[header + 2].startswith("| - | 3 | ")  # the test ids name no W: one row, its three cases


def test_the_run_ends_with_one_line_per_xpass(junit, tmp_path, monkeypatch, capsys):
    def sessions_that_wrote_the_junit(runs, out, timeout, gpus):
        for run in runs:
            shutil.copy(junit, out / f"{run.name}.xml")
            run.code = 0
        return {0: gpu_ci_launch.Wave(0.0, gpu_ci_load.WaveLoad())}

    monkeypatch.setattr(gpu_ci, "run_sessions", sessions_that_wrote_the_junit)
    gpu_ci.main(["--device", "cpu", "--steps", "stage1", "--out", str(tmp_path)])
    assert capsys.readouterr().out.splitlines()[-1] == XPASS_LINE


@pytest.mark.parametrize("one_wave", [False, True])
def test_the_vllm_sessions_run_after_the_pool_session_unless_in_one_wave(tmp_path, monkeypatch, one_wave):
    monkeypatch.setattr(gpu_ci, "vllm_missing", lambda: None)
    args = gpu_ci.parse_args(["--out", str(tmp_path), *(["--one-wave"] if one_wave else [])])
    args.workers = 4
    runs, _, _, left_out = gpu_ci.plan(args, tmp_path, gpus=1)
    waves = {run.name: run.wave for run in runs}
    later = 0 if one_wave else 1
    assert waves == {
        **{"pool": 0, "torchrun": 0, "torchrun-gpu": 0, "production-port": 0, "production-index": 0},
        **{name: later for name in ("vllm", "dsv41", "production")},
    }
    assert left_out is None


@pytest.mark.parametrize("users_policy", [None, "ACTIVE"])
def test_every_session_starts_with_idle_openmp_threads_asleep_unless_the_user_chose(
    tmp_path, monkeypatch, users_policy
):
    monkeypatch.setattr(gpu_ci, "vllm_missing", lambda: None)
    if users_policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", users_policy)
    args = gpu_ci.parse_args(["--out", str(tmp_path)])
    args.workers = 4
    runs, _, _, _ = gpu_ci.plan(args, tmp_path, gpus=1)
    assert {run.name: run.env.get("OMP_WAIT_POLICY") for run in runs} == {
        run.name: users_policy or "PASSIVE" for run in runs
    }


def test_a_cases_wait_for_the_gpu_ledger_is_its_own_column_not_checking(tmp_path):
    xml = tmp_path / "pool.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname="test_known_defects" name="test_fine" time="10.0"><properties>'
        '<property name="dcp_pool_start_s" value="2.0"/><property name="dcp_gpu_ledger_wait_s" value="3.5"/>'
        "</properties></testcase></testsuite></testsuites>"
    )
    rows, phases, xfails, xpasses = gpu_ci.summarize({xml: {"stage1": ["test_known_defects.py"]}})
    table = gpu_ci.render(rows, phases, [], ["stage1"], xfails, xpasses).splitlines()
    header = next(i for i, line in enumerate(table) if "| ledger wait s | checking s |" in line)
    assert table[header + 2].startswith("| stage1 | 1 | 10.0 | 2.0 | 0.0 | 0.0 | 0.0 | 3.5 | 4.5 |")


def test_each_session_says_its_workers_and_its_case_seconds_per_worker(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_ci, "vllm_missing", lambda: None)
    args = gpu_ci.parse_args(["--out", str(tmp_path)])
    args.workers = 4
    runs, _, _, _ = gpu_ci.plan(args, tmp_path, gpus=1)
    # As many as the session's argv starts: xdist's -n, else one.
    for run in runs:
        n = run.argv[run.argv.index("-n") + 1] if "-n" in run.argv else "1"
        assert run.workers == int(n), (run.name, run.argv)
    assert {run.name: run.workers for run in runs if run.name in ("pool", "torchrun", "vllm", "dsv41")} == {
        "pool": 4,
        "torchrun": 1,
        "vllm": 2,
        "dsv41": 3,
    }
    pool = next(run for run in runs if run.name == "pool")
    pool.code, pool.seconds = 0, 12.0
    phases = {step: gpu_ci_junit.Phases() for step in pool.steps}
    phases["stage1"].seconds, phases["e2e"].seconds = 20.0, 10.0
    table = gpu_ci.render({}, phases, [pool], list(pool.steps), [], []).splitlines()
    assert "| pool | 0 | 0 | 12.0 | 4 | 30.0 | 7.5 |" in table, table
