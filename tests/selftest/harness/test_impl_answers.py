"""What an implementation answers before launch (``unavailable_reason``,
``known_defect``) is checked: an answer of the wrong kind fails its test with
one message naming the implementation, the method and what is accepted, and
a known defect's ``shows`` that backtracks without bound cannot hang the
session."""

from __future__ import annotations

import time

import pytest

from dcpcheck.impls.protocol import KnownFailure
from dcpcheck.plugin.impl_answers import AnswerError, plain_known_defect
from tests.selftest.support.inner import run_inner_pytest, run_sessions_in_one_interpreter, write_session

pytestmark = pytest.mark.spawned_only

ANSWERS_IMPL = """
from dcpcheck.impls.protocol import KnownFailure


class Base:
    name = "hostile"

    def combine(self, *args, **kwargs):
        raise NotImplementedError


class NumberReason(Base):
    def unavailable_reason(self, terms):
        return 42


class NumberShows(Base):
    def known_defect(self, terms):
        return KnownFailure("planted defect", shows=42)


class ShowsBacktracks(Base):
    def known_defect(self, terms):
        return KnownFailure("planted defect", shows=r"(a+)+$")  # 2**40 ways to fail on the run of a's below
"""

ONE_CASE_TESTS = """
import pytest

pytestmark = pytest.mark.world_sizes(1)

def fails_after_a_run_of_as(ctx):
    assert False, "a" * 40 + "!"

def test_one_case(dcp):
    dcp.run(fails_after_a_run_of_as)
"""

# The inner session waits 1 s, not the plugin's bound, for the match of a known defect's shows.
SHORT_MATCH_BOUND = "import dcpcheck.plugin.known_failures\n\ndcpcheck.plugin.known_failures.MATCH_TIMEOUT_S = 1.0\n"

SESSIONS = {name: (["--dcp-impl", f"answers.py:{name}", "test_one.py"], {}) for name in ("NumberReason", "NumberShows")}


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    tmp_path = write_session(
        tmp_path_factory.mktemp("answers"), {"answers.py": ANSWERS_IMPL, "test_one.py": ONE_CASE_TESTS}
    )
    return run_sessions_in_one_interpreter(tmp_path, SESSIONS, timeout=120)


def _failure_line(output: str, prefix: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, output
    return lines[0]


def test_unavailable_reason_not_a_string_fails_its_test_naming_it(sessions):
    code, output = sessions["NumberReason"]
    assert code == 1 and "1 failed" in output, output
    assert "Traceback" not in output, output
    line = _failure_line(output, "answers.py:NumberReason.unavailable_reason(terms) returned")
    assert "returned an int; accepted: None or a string" in line, output


def test_known_defect_shows_not_a_string_fails_its_test_naming_it(sessions):
    code, output = sessions["NumberShows"]
    assert code == 1 and "1 failed" in output, output
    assert "Traceback" not in output, output
    line = _failure_line(output, "answers.py:NumberShows.known_defect(terms) returned")
    assert "a KnownFailure whose shows is an int; accepted:" in line, output


def test_shows_that_backtracks_without_bound_fails_its_case_in_bounded_time(tmp_path):
    write_session(tmp_path, {"answers.py": ANSWERS_IMPL, "test_one.py": SHORT_MATCH_BOUND + ONE_CASE_TESTS})
    started = time.perf_counter()
    code, output = run_inner_pytest(tmp_path, ["--dcp-impl", "answers.py:ShowsBacktracks", "test_one.py"], timeout=90)
    assert code == 1 and "1 failed" in output, output
    assert "not the known defect: known defect of answers.py:ShowsBacktracks: planted defect" in output
    assert (
        "answers.py:ShowsBacktracks.known_defect(terms) answered shows /(a+)+$/; matching it against this failure "
        "did not end within 1 s" in output
    ), output
    assert "AssertionError: aaaa" in output  # the failure itself follows
    assert time.perf_counter() - started < 60


class Unpicklable(KnownFailure):
    """A user's subclass, which the ranks under torchrun could not unpickle."""

    def __reduce__(self):
        raise TypeError("not picklable")


def test_a_known_failure_subclass_becomes_the_suite_s_own_plain_class():
    plain = plain_known_defect(Unpicklable("vendor bug", shows="rank 0"))
    assert type(plain) is KnownFailure and plain == KnownFailure("vendor bug", "rank 0")
    assert type(plain.reason) is str and type(plain.shows) is str


@pytest.mark.parametrize(
    "answer, said",
    [
        (KnownFailure("vendor bug", shows="(unclosed"), "whose shows '(unclosed' is not a regular expression"),
        (KnownFailure(b"vendor bug", shows="rank 0"), "whose reason is a bytes"),
        (3.5, "returned a float"),
    ],
    ids=["shows does not compile", "reason not a string", "neither"],
)
def test_a_known_defect_of_the_wrong_kind_says_what_is_accepted(answer, said):
    with pytest.raises(AnswerError, match="accepted: None, a string") as raised:
        plain_known_defect(answer)
    assert said in str(raised.value)
