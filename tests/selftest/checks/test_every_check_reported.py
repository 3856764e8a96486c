"""A rank function that runs several checks reports every mismatch, and one
found before a later check raised is never lost behind that error."""

from __future__ import annotations

import pytest

from dcpcheck.compare import MismatchError, run_every_check


def _mismatch(text: str):
    def check():
        raise MismatchError(text)

    return check


def _raises():
    raise RuntimeError("the implementation fell over")


def test_every_mismatch_is_reported_together():
    with pytest.raises(MismatchError) as info:
        run_every_check(
            [("geometry", _mismatch("pages wrong")), ("remap", lambda: None), ("buffer", _mismatch("row 3"))]
        )
    assert str(info.value) == "pages wrong\nrow 3"


def test_a_mismatch_is_kept_when_a_later_check_raises():
    with pytest.raises(MismatchError) as info:
        run_every_check([("remap", _mismatch("ids misplaced")), ("buffer", _raises)])
    assert str(info.value) == "ids misplaced\nthen buffer raised RuntimeError: the implementation fell over"
    assert isinstance(info.value.__cause__, RuntimeError)


def test_an_error_with_no_mismatch_before_it_is_raised_as_it_is():
    with pytest.raises(RuntimeError, match="fell over"):
        run_every_check([("geometry", lambda: None), ("buffer", _raises)])
