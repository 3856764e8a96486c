"""The input check against an implementation that evades it: a write into
the caller's buffer beyond the view it was given, a changed input whose class
lies about its comparisons, an object that refuses (or ignores) having its
methods shadowed, and a write whose rank is then left stuck by a peer that
failed first."""

from __future__ import annotations

from contextlib import suppress
from dataclasses import dataclass

import pytest
import torch

from dcpcheck.ranks.input_guard import InputChangedError, inputs_read_only
from tests.selftest.support.inner import run_sessions_in_one_interpreter, write_session


def column_slice_of_a_wider_buffer() -> torch.Tensor:
    return torch.arange(24, dtype=torch.int32).reshape(3, 8)[:, :4]


class WritesPastItsView:
    name = "writes-past-its-view"

    def filter_index(self, topk, token_to_req, block_table, is_valid_token, **options):
        block_table.as_strided((1,), (1,), block_table.storage_offset() + 5)[0] = -7  # column 5 of row 0
        return topk, token_to_req


def test_a_write_beyond_the_view_into_its_storage_is_named():
    table = column_slice_of_a_wider_buffer()
    with inputs_read_only(impl := WritesPastItsView(), rank=0) as guard:
        with suppress(InputChangedError):  # raised as the call returns
            impl.filter_index(torch.zeros(2), None, table, None, bs=4, world_size=1, rank=0, interleave=1)
    assert guard.violations == [
        "filter_index changed its input `block_table` in place (rank 0, 4 bytes of its storage outside the view it "
        "was given)"
    ]


class ClaimsNothingChanged(torch.Tensor):
    """A tensor whose every comparison, and every copy, says it equals what it was."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.equal, torch.Tensor.equal):
            return True
        if func in (torch.Tensor.__ne__, torch.Tensor.ne, torch.ne):
            return torch.zeros(args[0].shape, dtype=torch.bool)
        return super().__torch_function__(func, types, args, kwargs or {})


class ZeroesItsOutputLying:
    name = "zeroes-lying"

    def combine(self, out, lse, group, **options):
        out.zero_()  # W=1 returns its input: only the input check sees the zeros
        out.__class__ = ClaimsNothingChanged
        return out


def test_an_input_whose_comparisons_lie_is_compared_by_its_bits():
    out = torch.ones(4, 2, 3)
    with inputs_read_only(impl := ZeroesItsOutputLying(), rank=0) as guard:
        with suppress(InputChangedError):  # raised as the call returns
            impl.combine(out, torch.zeros(4, 2), None)
    assert guard.violations and "24 of 24 elements" in guard.violations[0]


class Writer:
    name = "writer"

    def combine(self, out, lse, group, **options):
        lse.view(-1)[:3] += 1.0
        return out


@dataclass(frozen=True)
class FrozenWriter(Writer):
    name: str = "frozen"


class SlotsWriter:  # no instance dict to shadow its methods in
    __slots__ = ()
    name = "slots"
    combine = Writer.combine


class RaisingSetattrWriter(Writer):
    def __setattr__(self, name, value):
        raise AttributeError(f"{name} is read-only")


class IgnoringSetattrWriter(Writer):
    def __setattr__(self, name, value):
        pass  # the assignment is dropped: the shadowing wrapper never takes


class PropertyWriter:
    name = "property"

    @property
    def combine(self):  # a data descriptor: an instance attribute cannot shadow it
        return Writer().combine


@pytest.mark.parametrize(
    "impl",
    [FrozenWriter(), SlotsWriter(), RaisingSetattrWriter(), IgnoringSetattrWriter(), PropertyWriter()],
    ids=lambda impl: type(impl).__name__,
)
def test_an_object_refusing_assignment_is_still_checked_and_left_as_it_was(impl):
    out, lse = torch.zeros(4, 2, 3), torch.zeros(4, 2)
    with inputs_read_only(impl, rank=0) as guard:
        with suppress(InputChangedError):  # raised as the call returns
            impl.combine(out, lse, None)
    assert len(guard.violations) == 1 and "3 of 8 elements" in guard.violations[0]
    assert type(impl) in (FrozenWriter, SlotsWriter, RaisingSetattrWriter, IgnoringSetattrWriter, PropertyWriter)
    assert "combine" not in getattr(impl, "__dict__", {})


class LiesAboutItsMethods(Writer):
    def __getattribute__(self, name):
        return Writer.combine.__get__(self) if name == "combine" else object.__getattribute__(self, name)


def test_an_object_that_cannot_be_instrumented_is_named_not_skipped():
    impl = LiesAboutItsMethods()
    with inputs_read_only(impl, rank=0) as guard:
        impl.combine(torch.zeros(4, 2, 3), torch.zeros(4, 2), None)
    assert guard.violations == [
        "the calls of LiesAboutItsMethods cannot be checked: `combine` read back as another object than the "
        "wrapper put in its place (its class decides what an attribute read finds)"
    ]
    assert "InputCheckError" in guard.error()


WRITER_LEFT_STUCK_IMPL = """
from dcpcheck.port.impl import EmbeddedPort


class WritesThenWaits(EmbeddedPort):
    name = "writes-then-waits"

    @staticmethod
    def combine(out, lse, group, **options):
        if group.rank_in_group == 1:
            lse.t()[0, 0] = 5.0  # through a view
        return EmbeddedPort.combine(out, lse, group, **options)
"""

WRITER_LEFT_STUCK_TESTS = """
import pytest
import torch

pytestmark = pytest.mark.world_sizes(2)

def rank_0_fails_first(ctx):
    out, lse = torch.zeros(20, 8, 4, device=ctx.device), torch.zeros(8, 20, device=ctx.device).t()
    ctx.impl.combine(out, lse, ctx.group, backend="ag_rs", lse_base=2.0)
    assert ctx.rank != 0, "planted: rank 0 fails at once"
    ctx.impl.combine(out, lse, ctx.group, backend="ag_rs", lse_base=2.0)  # rank 1 waits here for rank 0

def test_writer_left_stuck(dcp):
    dcp.run(rank_0_fails_first)
"""


def test_a_write_is_reported_even_when_a_peer_fails_first_and_the_writer_would_be_left_stuck(tmp_path):
    write_session(tmp_path, {"stuck_writer.py": WRITER_LEFT_STUCK_IMPL, "test_stuck.py": WRITER_LEFT_STUCK_TESTS})
    sessions = {"stuck": (["--dcp-impl", "stuck_writer:WritesThenWaits", "--world-sizes", "2", "test_stuck.py"], {})}
    code, output = run_sessions_in_one_interpreter(tmp_path, sessions, timeout=120)["stuck"]
    assert code == 1 and "1 failed" in output, output
    assert "planted: rank 0 fails at once" in output, output
    assert "[rank 1] InputChangedError: combine changed its input `lse` in place (rank 1, 1 of 160 elements)" in output
