"""Each test file's duration is measured at session end (under xdist by the
controller, from every worker's reports) and read back by the schedulers;
without a table they keep their cold-start order
(``dcpcheck/plugin/file_durations.py``)."""

from __future__ import annotations

import ast
import json
import sys

import pytest

from dcpcheck.plugin.file_durations import DURATIONS_PATH, handed_out_order, read_durations
from tests.selftest.support.inner import REPO_ROOT, run_inner_pytest, write_session

sys.path.insert(0, str(REPO_ROOT / "tools"))
import gpu_ci  # tools/ is on sys.path

pytestmark = pytest.mark.spawned_only

SLOW = "import time\n\ndef test_sleeps():\n    time.sleep(0.5)\n\ndef test_quick():\n    pass\n"
QUICK = "def test_quick():\n    pass\n"


def test_cold_start_keeps_the_default_order():
    assert handed_out_order({}, ("b.py", "a.py")) == ("b.py", "a.py")


def test_measured_files_go_first_longest_first_then_the_default_order():
    assert handed_out_order({"a.py": 1.0, "c.py": 3.0}, ("b.py", "a.py", "d.py")) == ("c.py", "a.py", "b.py", "d.py")


def test_gpu_ci_lists_its_files_by_the_measured_durations_else_its_own_order():
    gate, orphans, failures = "tests/e2e/test_gate.py", *gpu_ci.LONGEST_FIRST[1::-1]
    assert gpu_ci.longest_first([gate, orphans, failures], {}) == [failures, orphans, gate]
    assert gpu_ci.longest_first([gate, orphans, failures], {gate: 500.0}) == [gate, failures, orphans]


def test_the_cold_start_lists_name_test_files_that_exist():
    # A moved file left in a list is silently scheduled last: its session's longest file would start late.
    conftest = ast.parse((REPO_ROOT / "tests" / "conftest.py").read_text())
    (readme_list,) = [
        ast.literal_eval(node.value)
        for node in conftest.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "LONGEST_FILES" for t in node.targets)
    ]
    missing = [path for path in (*readme_list, *gpu_ci.LONGEST_FIRST) if not (REPO_ROOT / path).is_file()]
    assert not missing, f"cold-start lists name files that do not exist: {missing}"


def test_a_missing_or_unreadable_table_is_none(tmp_path):
    assert read_durations(tmp_path / "none.json", "cpu port") == {}
    (tmp_path / "bad.json").write_text("{not json")
    assert read_durations(tmp_path / "bad.json", "cpu port") == {}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """The table of an xdist session over two files, then of a session
    narrowed by -k (which writes nothing)."""
    tmp_path = write_session(tmp_path_factory.mktemp("durations"), {"test_slow.py": SLOW, "test_quick.py": QUICK})
    code, output = run_inner_pytest(tmp_path, ["-n", "2"], timeout=120)
    assert code == 0, output
    table = json.loads((tmp_path / DURATIONS_PATH).read_text())
    code, output = run_inner_pytest(tmp_path, ["-k", "quick"], timeout=120)
    assert code == 0, output
    return table, json.loads((tmp_path / DURATIONS_PATH).read_text())


def test_the_xdist_controller_writes_each_files_duration(measured):
    table, _ = measured
    [(key, seconds)] = table.items()
    assert key.endswith(" port"), table
    assert set(seconds) == {"test_slow.py", "test_quick.py"}, table
    assert seconds["test_slow.py"] >= 0.5 > seconds["test_quick.py"], table


def test_a_narrowed_session_leaves_the_table_as_it_was(measured):
    table, after_k = measured
    assert after_k == table
