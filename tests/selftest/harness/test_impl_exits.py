"""Every call the pytest process makes into the implementation (its import
and constructor, ``unavailable_reason``, ``describe``) is bounded, and
whatever it raises, ``SystemExit`` included, becomes one error naming the
method: never INTERNALERROR, a bare traceback or a hung session. An import
that never lets Python run again (spinning in C with the GIL held) is
ended by a watchdog process within ``--dcp-startup-timeout``."""

from __future__ import annotations

import time

import pytest

from tests.selftest.support.inner import run_inner_pytest, run_sessions_in_one_interpreter, write_session

pytestmark = pytest.mark.spawned_only

EXITS_IMPL = """
import sys
import time


class Base:
    name = "exits"

    def combine(self, *args, **kwargs):
        raise NotImplementedError


class ExitsInInit(Base):
    def __init__(self):
        sys.exit(0)


class ReasonExits(Base):
    def unavailable_reason(self, terms):
        raise SystemExit(3)


class DescribeExits(Base):
    def describe(self):
        raise SystemExit(5)


class DescribeHangs(Base):
    def describe(self):
        time.sleep(10**6)
"""

EXITS_AT_IMPORT = "import sys\n\nsys.exit(0)\n\nclass Impl:\n    def combine(self, *args):\n        pass\n"

ONE_CASE_TESTS = """
import pytest

pytestmark = [pytest.mark.world_sizes(1), pytest.mark.stage(3)]

def passes(ctx):
    return None

def test_one_case(dcp):
    dcp.run(passes)
"""

SESSIONS = {
    "ExitsAtImport": ["--dcp-impl", "exits_at_import.py:Impl"],
    **{name: ["--dcp-impl", f"exits.py:{name}"] for name in ("ExitsInInit", "ReasonExits", "DescribeExits")},
    "DescribeHangs": ["--dcp-impl", "exits.py:DescribeHangs", "--dcp-timeout", "2"],
}


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    tmp_path = write_session(
        tmp_path_factory.mktemp("exits"),
        {"exits.py": EXITS_IMPL, "exits_at_import.py": EXITS_AT_IMPORT, "test_one.py": ONE_CASE_TESTS},
    )
    cases = {name: ([*args, "test_one.py"], {}) for name, args in SESSIONS.items()}
    started = time.perf_counter()
    results = run_sessions_in_one_interpreter(tmp_path, cases, timeout=120)
    return results, time.perf_counter() - started


def _one_error(output: str) -> str:
    assert "INTERNALERROR" not in output and "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 1, output
    return errors[0]


def test_sys_exit_at_import_is_a_usage_error_naming_the_import(sessions):
    code, output = sessions[0]["ExitsAtImport"]
    assert code == 4, output
    assert "importing 'exits_at_import.py' raised SystemExit: 0" in _one_error(output), output


def test_sys_exit_in_the_constructor_is_a_usage_error_naming_it(sessions):
    code, output = sessions[0]["ExitsInInit"]
    assert code == 4, output
    assert "calling ExitsInInit() raised SystemExit: 0" in _one_error(output), output


def test_unavailable_reason_exiting_fails_its_case_naming_the_method(sessions):
    code, output = sessions[0]["ReasonExits"]
    assert code == 1 and "1 failed" in output and "INTERNALERROR" not in output, output
    assert "exits.py:ReasonExits.unavailable_reason(terms) raised SystemExit: 3 (it is asked before launch" in output


def test_describe_exiting_is_named_under_the_stage_table_and_the_run_still_passes(sessions):
    code, output = sessions[0]["DescribeExits"]
    assert code == 0 and "1 passed" in output and "Traceback" not in output, output
    assert "exits.py:DescribeExits.describe() raised SystemExit: 5" in output, output


def test_describe_that_never_returns_is_abandoned_within_the_case_timeout(sessions):
    code, output = sessions[0]["DescribeHangs"]
    assert code == 0 and "1 passed" in output, output
    assert "exits.py:DescribeHangs.describe() did not return within 2 s (--dcp-timeout); stuck at" in output
    assert "time.sleep(10**6)" in output, output
    assert sessions[1] < 60


SPINS_HOLDING_THE_GIL = (
    "import re\n\nre.match(r'(a+)+$', 'a' * 64 + '!')  # backtracks for years, never returning to the eval loop\n"
)


def test_an_import_spinning_in_c_with_the_gil_held_is_killed_at_the_startup_deadline(tmp_path):
    write_session(tmp_path, {"test_nothing.py": "def test_nothing():\n    pass\n"})
    (tmp_path / "spins").mkdir()
    (tmp_path / "spins" / "__init__.py").write_text(SPINS_HOLDING_THE_GIL)
    (tmp_path / "spins" / "impl.py").write_text("class Impl:\n    def combine(self, *args):\n        pass\n")
    started = time.perf_counter()
    code, output = run_inner_pytest(
        tmp_path, ["--dcp-impl", "spins.impl:Impl", "--dcp-startup-timeout", "2", "test_nothing.py"], timeout=60
    )
    seconds = time.perf_counter() - started
    assert code == -9, output  # SIGKILL: nothing of that process could run again
    error = [line for line in output.splitlines() if line.startswith("ERROR:")]
    assert len(error) == 1, output
    assert "--dcp-impl spins.impl:Impl: loading it did not end within 2 s (--dcp-startup-timeout)" in error[0]
    assert "stuck in C code holding the GIL" in error[0], output
    assert 'spins/__init__.py", line 3 in <module>' in output, output  # faulthandler's stack of the import
    assert seconds < 30, output
