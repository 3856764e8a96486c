"""A known defect with ``cures`` hides no second bug: a case it marks that
fails as it shows runs once more with its cause neutralised
(``Implementation.cured``), and fails, naming the second bug, unless that run
passes; a pass of the first run is an XPASS and needs no second run."""

from __future__ import annotations

import pytest

from tests.selftest.support.inner import run_sessions_in_one_interpreter, write_session

pytestmark = pytest.mark.spawned_only

CURED_IMPL = """
import contextlib

from dcpcheck.impls.protocol import KnownFailure


class OneDefect:
    name = "cured"
    cures = ()
    has_defect, has_second_bug = True, False

    @contextlib.contextmanager
    def cured(self, cures):
        self.cures = cures
        try:
            yield
        finally:
            self.cures = ()

    def combine(self, *args, **kwargs):
        raise NotImplementedError

    def known_defect(self, terms):
        return KnownFailure("planted defect", shows="planted output mismatch", cures=("planted_fix",))

    def output_error(self):
        if self.has_defect and "planted_fix" not in self.cures:
            return "planted output mismatch (the defect)"
        if self.has_second_bug:
            return "planted output mismatch (a second bug, failing as the defect does)"
        return None


class SecondBug(OneDefect):
    has_second_bug = True


class Fixed(OneDefect):
    has_defect = False


class CuresWithoutCured(OneDefect):
    cured = None


class CureSwallows(OneDefect):
    has_second_bug = True

    def cured(self, cures):
        outer = self

        class Swallows:
            def __enter__(self):
                outer.cures = cures

            def __exit__(self, *exc_info):
                outer.cures = ()
                return True  # swallows whatever the case raised

        return Swallows()
"""

ONE_CASE_TESTS = """
import pytest

pytestmark = pytest.mark.world_sizes(2)

def check_output(ctx):
    error = ctx.impl.output_error()
    assert error is None, f"{error} [first failure suffices: {ctx.case.first_failure_suffices}]"

def test_one_case(dcp):
    dcp.run(check_output)
"""

IMPLS = ("OneDefect", "SecondBug", "Fixed", "CuresWithoutCured", "CureSwallows")


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    tmp_path = write_session(
        tmp_path_factory.mktemp("cured"), {"cured_impl.py": CURED_IMPL, "test_one.py": ONE_CASE_TESTS}
    )
    cases = {name: (["--dcp-impl", f"cured_impl.py:{name}", "test_one.py", "-rxX"], {}) for name in IMPLS}
    return run_sessions_in_one_interpreter(tmp_path, cases, timeout=180)


def test_a_defect_its_cure_explains_is_an_expected_failure(sessions):
    code, output = sessions["OneDefect"]
    assert code == 0 and "1 xfailed" in output, output


def test_a_second_bug_behind_the_defect_fails_naming_the_cured_run(sessions):
    code, output = sessions["SecondBug"]
    assert code == 1 and "1 failed" in output, output
    assert "not the known defect: known defect of cured_impl.py:SecondBug: planted defect" in output, output
    assert (
        "a second bug behind the known defect: with cured_impl.py:SecondBug's cures planted_fix (the known "
        "defect's cause neutralised: planted defect) the case still fails:" in output
    ), output
    # The run with the defect has only to show it; the cured run checks everything.
    second_bug = "planted output mismatch (a second bug, failing as the defect does) [first failure suffices: False]"
    assert second_bug in output, output
    assert "the run with the known defect:" in output, output
    assert "planted output mismatch (the defect) [first failure suffices: True]" in output, output


def test_a_fixed_defect_is_an_xpass(sessions):
    code, output = sessions["Fixed"]
    assert "1 xpassed" in output, output


def test_cures_without_a_cured_method_fail_the_case_naming_it(sessions):
    code, output = sessions["CuresWithoutCured"]
    assert code == 1 and "1 failed" in output, output
    assert (
        "cured_impl.py:CuresWithoutCured.known_defect(terms) returned a KnownFailure with cures ('planted_fix',) "
        "but has no cured() method" in output
    ), output


def test_a_cure_that_swallows_the_case_s_error_fails_the_case_naming_it(sessions):
    code, output = sessions["CureSwallows"]
    assert code == 1 and "1 failed" in output and "UnboundLocalError" not in output, output
    assert "a second bug behind the known defect" in output, output
    assert (
        "CureSwallowedError: the implementation's cured(planted_fix) swallowed the case's error (AssertionError: "
        "planted output mismatch (a second bug" in output
    ), output
    assert "its __exit__ returned True; a cure must let the case's errors through" in output, output
