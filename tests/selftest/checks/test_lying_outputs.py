"""The output comparison reads what an implementation returns by its bits,
through a plain view of its memory: a tensor subclass whose methods lie
(every difference zero, every comparison equal) cannot make a false pass,
and one with no plain memory is a mismatch naming it."""

from __future__ import annotations

import pytest
import torch

from dcpcheck.compare import (
    Expected,
    MismatchError,
    TokenRows,
    assert_close,
    assert_equal_ints,
    assert_lse_close,
    assert_outputs,
    assert_row_sets_equal,
)

LIES = {
    torch.Tensor.__sub__: lambda args: torch.zeros(args[0].shape, dtype=torch.float64),
    torch.Tensor.__ne__: lambda args: torch.zeros(args[0].shape, dtype=torch.bool),
    torch.Tensor.__eq__: lambda args: torch.ones(args[0].shape, dtype=torch.bool),
    torch.Tensor.tolist: lambda args: [[0, 1, 2]] * args[0].shape[0],
}


class LyingSubclass(torch.Tensor):
    """Says it equals whatever it is compared with: differences are zero,
    ``!=`` is all False, ``==`` all True, its rows list the expected ones."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in LIES:
            return LIES[func](args)
        return super().__torch_function__(func, types, args, kwargs or {})


def lying(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_subclass(LyingSubclass)


def test_a_lying_float_output_is_compared_by_its_values():
    expected = torch.ones(4, 2, 3)
    with pytest.raises(MismatchError, match="24 of 24 elements out of tolerance"):
        assert_close(lying(torch.zeros(4, 2, 3)), expected, what="out")
    with pytest.raises(MismatchError, match="4 of 4 elements out of tolerance"):
        assert_lse_close(lying(torch.zeros(4)), torch.ones(4), what="lse")


def test_a_lying_index_output_is_compared_by_its_values():
    expected = torch.tensor([[0, 1, 2], [0, 1, 2]])
    with pytest.raises(MismatchError, match="6 problem"):
        assert_equal_ints(lying(expected + 7), expected, case="case", what="slots", name_index=lambda *i: str(i))
    rows = TokenRows("case", [0, 1])
    with pytest.raises(MismatchError, match="token row 0 .*unexpected"):
        assert_row_sets_equal(lying(expected + 7), expected, rows, what="slots")


def test_the_checked_outputs_are_handed_on_as_plain_tensors():
    out = assert_outputs(
        "combine", lying(torch.zeros(4, 2, 3)), [Expected("out", (4, 2, 3), torch.float32)], device="cpu"
    )
    assert type(out) is torch.Tensor
    out, lse = assert_outputs(
        "combine",
        (lying(torch.zeros(4, 2, 3)), torch.zeros(4, 2)),
        [Expected("out", (4, 2, 3), torch.float32), Expected("lse", (4, 2), torch.float32)],
        device="cpu",
    )
    assert type(out) is torch.Tensor and type(lse) is torch.Tensor


class NoMemory(torch.Tensor):
    """A wrapper subclass: a shape and a dtype, every operation answered by its ``__torch_dispatch__``."""

    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return torch.zeros(())


def test_an_output_with_no_plain_memory_is_a_mismatch_naming_it():
    with pytest.raises(MismatchError, match="an output is a NoMemory .*cannot be read as plain memory"):
        assert_close(NoMemory((2,)), torch.zeros(2), what="out")
    with pytest.raises(MismatchError, match="an output is a LyingSubclass .*on meta"):
        assert_close(lying(torch.zeros(2, device="meta")), torch.zeros(2), what="out")
