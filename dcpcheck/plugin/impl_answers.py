"""What an implementation under test gives the harness, checked where the
harness takes it: plain data of the suite's own types, or one bounded error
naming the implementation, what was read and what is accepted.

* At session start (a usage error): every attribute the suite reads of an
  implementation reads without raising, and its answer methods are methods;
  otherwise every test of a stage would fail with the same traceback.
* Before each case (that case fails): the answers of ``unavailable_reason``
  and ``known_defect``. A ``KnownFailure`` becomes the suite's own class of
  exact strings: under torchrun rank 0 posts it to every rank (pickled), where
  a user's subclass need neither unpickle nor behave as the suite's.
"""

from __future__ import annotations

import dataclasses
import re
import traceback
from pathlib import Path

from dcpcheck.impls.conventions import Conventions
from dcpcheck.impls.protocol import CAPABILITIES, KnownFailure
from dcpcheck.ranks.rankfn import describe_exception

ANSWER_METHODS = ("unavailable_reason", "known_defect")
# What the suite reads of an implementation, wherever it has it (of its conventions, every field).
READ_ATTRIBUTES = ("name", "describe", "conventions", *ANSWER_METHODS, *CAPABILITIES)
READABLE = (
    "accepted: attributes that are absent, None or read without raising (the suite reads name, describe, "
    "conventions and its fields, unavailable_reason, known_defect and every capability)"
)
REASON_ACCEPTED = "accepted: None or a string (why the case cannot run here)"
DEFECT_ACCEPTED = (
    "accepted: None, a string, or a KnownFailure(reason, shows, cures=()) of two strings and a tuple of "
    "strings, shows a regular expression that the failure's text matches, cures names the implementation's "
    "cured() accepts (and only with a cured() method)"
)
MESSAGE_CHARS = 300  # of an exception's message or a pattern, in a one-line error


class AnswerError(ValueError):
    """An answer of the wrong kind: what it was, and what is accepted."""


def _cut(text: str) -> str:
    return text if len(text) <= MESSAGE_CHARS else f"{text[:MESSAGE_CHARS]}... ({len(text)} characters)"


def _one_line(exc: BaseException) -> str:
    return _cut(" ".join(describe_exception(exc, of_rank_function=False).split()))


def _kind(value) -> str:
    """'an int', 'a KnownFailure': what a value is, without running its code (a repr may raise, or be huge)."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _first_unreadable(obj, names, owner: str = "") -> str | None:
    """The error of the first of ``names`` that raises when read on ``obj``, else None."""
    for name in names:
        try:
            getattr(obj, name, None)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - the implementation's error (a sys.exit() too), named
            return f"reading its `{owner}{name}` raised {_one_line(exc)}; {READABLE}"
    return None


def _declaration_problems(impl):
    """Each problem of ``impl``'s declarations, lazily (None for each check
    passed): its conventions are read once its attributes are readable."""
    yield _first_unreadable(impl, READ_ATTRIBUTES)
    conventions = getattr(impl, "conventions", None)
    if conventions is not None:
        yield _first_unreadable(conventions, [field.name for field in dataclasses.fields(Conventions)], "conventions.")
    for method in ANSWER_METHODS:
        answer = getattr(impl, method, None)
        if answer is not None and not callable(answer):
            yield f"its `{method}` is {_kind(answer)}; accepted: a method taking the case's terms, absent or None"


def declaration_error(spec: str, impl) -> str | None:
    """The usage error of the first attribute the suite reads of ``impl`` that
    cannot be read, or of an answer method that is not one; else None."""
    problem = next(filter(None, _declaration_problems(impl)), None)
    return f"--dcp-impl {spec!r}: {problem}" if problem else None


def raised_while_loading(spec: str, exc: BaseException) -> str:
    """The usage error of an exception the registry does not expect while it
    builds and inspects the implementation: in practice an attribute that
    raises when read, which the innermost frame names."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (in {frames[-1].name}, {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"--dcp-impl {spec!r}: loading it raised {_one_line(exc)}{where}; {READABLE}"


def _exact_str(value: str) -> str:
    return str.__str__(value)  # a str subclass's own text, as a str, without its overrides


def plain_unavailable_reason(answer, impl=None) -> str | None:
    if answer is None:
        return None
    if isinstance(answer, str):
        return _exact_str(answer) or None
    raise AnswerError(f"returned {_kind(answer)}; {REASON_ACCEPTED}")


def _plain_cures(cures, impl) -> tuple[str, ...]:
    if not isinstance(cures, tuple) or not all(isinstance(cure, str) for cure in cures):
        raise AnswerError(f"returned a KnownFailure whose cures is {_kind(cures)}; {DEFECT_ACCEPTED}")
    if cures and not callable(getattr(impl, "cured", None)):
        raise AnswerError(f"returned a KnownFailure with cures {cures!r} but has no cured() method; {DEFECT_ACCEPTED}")
    return tuple(_exact_str(cure) for cure in cures)


def _plain_known_failure(answer: KnownFailure, impl) -> KnownFailure:
    reason, shows = answer.reason, answer.shows
    for field, text in (("reason", reason), ("shows", shows)):
        if not isinstance(text, str):
            raise AnswerError(f"returned a KnownFailure whose {field} is {_kind(text)}; {DEFECT_ACCEPTED}")
    try:
        re.compile(shows)
    except re.error as exc:
        raise AnswerError(
            f"returned a KnownFailure whose shows {_cut(repr(_exact_str(shows)))} is not a regular expression "
            f"({exc}); {DEFECT_ACCEPTED}"
        ) from None
    return KnownFailure(_exact_str(reason), _exact_str(shows), _plain_cures(answer.cures, impl))


def plain_known_defect(answer, impl=None) -> KnownFailure | str | None:
    if answer is None:
        return None
    if isinstance(answer, KnownFailure):
        return _plain_known_failure(answer, impl)
    if isinstance(answer, str):
        return _exact_str(answer) or None
    raise AnswerError(f"returned {_kind(answer)}; {DEFECT_ACCEPTED}")


PLAIN_ANSWERS = {"unavailable_reason": plain_unavailable_reason, "known_defect": plain_known_defect}


def plain_answer(method: str, ask, terms):
    """``ask(terms)`` (the implementation's ``method``) as plain data; raises
    :class:`AnswerError` for an answer of the wrong kind. Run where the call
    is bounded: reading a user's subclass runs its code."""
    return PLAIN_ANSWERS[method](ask(terms), getattr(ask, "__self__", None))
