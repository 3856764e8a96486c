"""What the input check counts as a changed input element: a value that
differs, NaN where a number was and back; not a NaN left NaN (whatever its
bits) nor a zero's sign, in every dtype a capability is given."""

from __future__ import annotations

import math

import pytest
import torch

from dcpcheck.ranks.input_guard import _changed_elements

NAN_WITH_ANOTHER_PAYLOAD = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        ([1.0, math.nan, 3.0], [1.0, math.nan, 3.0], None),
        ([1.0, math.nan, 3.0], [1.0, math.nan, 4.0], "1 of 3 elements"),
        ([1.0, math.nan, 3.0], [1.0, 2.0, 3.0], "1 of 3 elements"),
        ([1.0, 2.0, 3.0], [math.nan, 2.0, math.nan], "2 of 3 elements"),
        ([0.0, 2.0, 3.0], [-0.0, 2.0, 3.0], None),
        ([1.0, -math.nan, 3.0], [1.0, math.nan, 3.0], None),
    ],
)
def test_changed_floats(dtype, before, after, expected):
    assert _changed_elements(torch.tensor(before, dtype=dtype), torch.tensor(after, dtype=dtype)) == expected


def test_a_nan_whose_bits_changed_is_unchanged():
    before = torch.tensor([math.nan, 1.0])
    assert _changed_elements(before, torch.tensor([NAN_WITH_ANOTHER_PAYLOAD, 1.0])) is None


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.int8])
def test_changed_integers(dtype):
    before = torch.tensor([1, 0, 1], dtype=dtype)
    assert _changed_elements(before, before.clone()) is None
    assert _changed_elements(before, torch.tensor([1, 1, 1], dtype=dtype)) == "1 of 3 elements"


def test_a_strided_view_and_a_resize():
    base = torch.arange(12.0).view(3, 4)
    view = base[:, ::2]
    before = view.clone()
    assert _changed_elements(before, view) is None
    base[1, 2] = math.nan
    assert _changed_elements(before, view) == "1 of 6 elements"
    assert _changed_elements(before, view[:2]) == "resized from [3, 2] to [2, 2]"
