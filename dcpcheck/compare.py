"""Tolerances, error statistics and failure messages: the one home for all.

Every check of the suite compares through this module, so a failure always
names what differs, the worst error and where (token, head, dim / slot).
Each tensor is read through a plain view of its memory
(:func:`dcpcheck.plain_tensors.plain`): a subclass the implementation returns
cannot lie to a comparison about its values.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dcpcheck.oracle.attention import EMPTY_LSE, is_empty_lse
from dcpcheck.plain_tensors import UnreadableTensorError, plain


class MismatchError(AssertionError):
    """A result differs from its reference; the message says where and by how much."""


# The first line of each comparison failure raised here (assert_close's and
# fail_if_problems'): what was compared, where, and how much of it is off.
# A known defect must explain every such line of a failure.
HEADLINE = re.compile(r" \d+ of \d+ elements out of tolerance \(|: \d+ problem\(s\)$")


# ---- exact comparisons (index tensors, counts, slot sets) ------------------

MAX_REPORTED = 8  # problems (and values per problem) spelled out in one message


class TokenRows:
    """Names the token rows of a batch in failure messages.

    ``case`` says which case, world size and rank produced the tensors;
    ``token_to_req`` and ``labels`` (e.g. "decode, recent ids") say what
    each row is.
    """

    def __init__(self, case: str, token_to_req, labels=()):
        self.case = case
        self.requests = [int(x) for x in _as_list(token_to_req)]
        self.labels = tuple(labels)

    def name(self, t: int) -> str:
        label = f", {self.labels[t]}" if self.labels else ""
        return f"token row {t} (request {self.requests[t]}{label})"


def _as_list(values) -> list:
    values = _plain(values)
    return values.tolist() if hasattr(values, "tolist") else list(values)


def _plain(value):
    """``value`` read through a plain view (:func:`plain`); one that has no plain memory is a mismatch."""
    try:
        return plain(value)
    except UnreadableTensorError as exc:
        raise MismatchError(f"an output is {exc}") from None


def _listing(values) -> str:
    values = list(values)
    shown = ", ".join(map(str, values[:MAX_REPORTED]))
    more = len(values) - MAX_REPORTED
    return f"[{shown}, ... {more} more]" if more > 0 else f"[{shown}]"


def fail_if_problems(case: str, what: str, problems: list[str], total: int | None = None) -> None:
    """Raise :class:`MismatchError` listing the first problems, if there are any.
    ``total`` is the number of problems when only the first ones were spelled out."""
    total = len(problems) if total is None else total
    if total == 0:
        return
    lines = [f"{case}: {what}: {total} problem(s)"]
    lines += [f"  {problem}" for problem in problems[:MAX_REPORTED]]
    if total > MAX_REPORTED:
        lines.append(f"  ... and {total - MAX_REPORTED} more")
    raise MismatchError("\n".join(lines))


def run_every_check(checks: Sequence[tuple[str, Callable[[], object]]]) -> None:
    """Run every ``(name, check)``; raise one :class:`MismatchError` listing
    all their mismatches. A check that raises anything else after a mismatch
    was found does not hide it: both are reported (the error chained)."""
    problems = []
    for name, check in checks:
        try:
            check()
        except MismatchError as exc:
            problems.append(str(exc))
        except Exception as exc:
            if not problems:
                raise
            raised = f"then {name} raised {type(exc).__name__}: {exc}"
            raise MismatchError("\n".join([*problems, raised])) from exc
    if problems:
        raise MismatchError("\n".join(problems))


def assert_compact_prefix(slots, counts, rows: TokenRows, *, what: str) -> None:
    """Row ``t`` of ``slots [T, K]`` holds ``counts[t]`` entries >= 0, then only -1."""
    slots, counts = _plain(slots), _plain(counts)
    width = slots.shape[1]
    problems = []
    for t, (row, count) in enumerate(zip(slots.tolist(), counts.tolist())):
        if not 0 <= count <= width:
            problems.append(f"{rows.name(t)}: count {count} outside [0, {width}]")
            continue
        gaps = [f"{row[k]} at column {k}" for k in range(count) if row[k] < 0]
        tail = [f"{row[k]} at column {k}" for k in range(count, width) if row[k] != -1]
        if gaps:
            problems.append(f"{rows.name(t)}: count {count} but the prefix holds {_listing(gaps)}")
        if tail:
            problems.append(f"{rows.name(t)}: after the prefix of {count}, expected -1, got {_listing(tail)}")
    fail_if_problems(rows.case, f"{what} are not a compact prefix with a -1 tail", problems)


def assert_row_sets_equal(actual, expected, rows: TokenRows, *, what: str) -> None:
    """Per token row, the entries >= 0 of ``actual`` and of ``expected`` form the
    same set (order ignored, widths may differ); an entry repeated in
    ``actual`` is a problem too."""
    problems = []
    for t, (got_row, want_row) in enumerate(zip(_plain(actual).tolist(), _plain(expected).tolist())):
        got, repeated = set(), set()
        for value in got_row:
            if value >= 0:
                (repeated if value in got else got).add(value)
        want = {value for value in want_row if value >= 0}
        parts = []
        if got - want:
            parts.append(f"unexpected {_listing(sorted(got - want))}")
        if want - got:
            parts.append(f"missing {_listing(sorted(want - got))}")
        if repeated:
            parts.append(f"repeated {_listing(sorted(repeated))}")
        if parts:
            problems.append(f"{rows.name(t)}: " + "; ".join(parts))
    fail_if_problems(rows.case, what, problems)


def assert_rows_disjoint(per_rank, rows: TokenRows, *, what: str) -> None:
    """No entry >= 0 of a token row is held by two ranks; ``per_rank`` is [W, T, K]."""
    per_rank = _plain(per_rank)
    problems = []
    for t in range(per_rank.shape[1]):
        holder: dict[int, int] = {}
        clashes = []
        for rank, row in enumerate(per_rank[:, t].tolist()):
            for value in sorted({v for v in row if v >= 0}):
                if value in holder:
                    clashes.append(f"{value} on ranks {holder[value]} and {rank}")
                else:
                    holder[value] = rank
        if clashes:
            problems.append(f"{rows.name(t)}: {_listing(clashes)}")
    fail_if_problems(rows.case, what, problems)


def assert_equal_ints(actual, expected, *, case: str, what: str, name_index) -> None:
    """Elementwise equality of two integer tensors of one shape.
    ``name_index(*index)`` says in words where an element is (e.g. a token row)."""
    actual, expected = _plain(actual), _plain(expected)
    if tuple(actual.shape) != tuple(expected.shape):
        raise MismatchError(f"{case}: {what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    actual, expected = actual.long(), expected.long()
    wrong = (actual != expected).nonzero().tolist()
    problems = [
        f"{name_index(*index)}: got {actual[tuple(index)].item()}, expected {expected[tuple(index)].item()}"
        for index in wrong[:MAX_REPORTED]
    ]
    fail_if_problems(case, what, problems, total=len(wrong))


# ---- what a capability returns: arity, and each output's shape, dtype, device ----


@dataclass(frozen=True)
class Expected:
    """One output of a capability as the contract states it; ``dtype`` None
    accepts any integer dtype (an index tensor whose width is free)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None


def assert_outputs(capability: str, result, expected: Sequence[Expected], *, device, context: str = ""):
    """``result`` of ``capability`` is one tensor (one ``expected``) or a tuple
    of as many, each of the stated shape, dtype and device; else a
    :class:`MismatchError` naming the capability, the output and what was
    expected. Returns ``result``, each tensor read through a plain view (:func:`plain`)."""
    where = f" ({context})" if context else ""
    if isinstance(result, tuple | list):
        result = type(result)(_plain(output) for output in result) if type(result) in (tuple, list) else result
    else:
        result = _plain(result)
    outputs = (result,) if len(expected) == 1 else result
    if len(expected) > 1 and not (isinstance(result, tuple | list) and len(result) == len(expected)):
        got = (
            f"a {type(result).__name__} of {len(result)}" if isinstance(result, tuple | list) else type(result).__name__
        )
        names = ", ".join(spec.name for spec in expected)
        raise MismatchError(f"{capability} returned {got}, expected a tuple ({names}){where}")
    problems = []
    for spec, tensor in zip(expected, outputs):
        if not isinstance(tensor, torch.Tensor):
            problems.append(f"{spec.name} is a {type(tensor).__name__}, not a tensor")
            continue
        dtype_ok = tensor.dtype == spec.dtype if spec.dtype is not None else not tensor.is_floating_point()
        want_device = torch.device(device)
        device_ok = tensor.device.type == want_device.type and want_device.index in (None, tensor.device.index)
        if tuple(tensor.shape) != spec.shape or not dtype_ok or not device_ok:
            want = str(spec.dtype) if spec.dtype is not None else "an integer dtype"
            problems.append(
                f"{spec.name} {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}, "
                f"expected {spec.shape} {want} on {want_device}"
            )
    if problems:
        raise MismatchError(f"{capability} returned " + "; ".join(problems) + where)
    return result


# ---- floating-point comparisons (tolerances live here and nowhere else) ----


@dataclass(frozen=True)
class Tolerance:
    """|actual - expected| <= atol + rtol * |expected|, elementwise."""

    atol: float
    rtol: float

    def describe(self) -> str:
        return f"atol {self.atol:g} + rtol {self.rtol:g} * |expected|"


# (quantity, dtype of the result) -> tolerance. "out": an attention or combine
# output (values O(1)) against a float64 reference computed from the same,
# already rounded, inputs (a quantized cache's too: the oracle reads the values
# its record gives back, exact in bf16, so fp8_ds_mla adds no term; CONTRACT.md
# §8 derives it); for fp16/bf16 atol is one ulp at 1 and rtol two ulps
# (the partials round once, the merged output once more); for fp32 both cover
# the fp32 softmax and merge arithmetic. "lse": an fp32 LSE (fp32 math, values
# up to a few hundred). Measured worst |err| / allowed on CPU and H200: <= 0.4.
# Tight enough that a base mix-up, or the sink or window counted on every
# rank, fails by orders of magnitude (the stage-3 break-it runs show it).
#
# "out_rounded_once": a 16-bit combine output whose merge runs in fp32 and is
# rounded once to the output dtype, against the float64 merge of partials with
# |out| <= 1. One rounding, in any mode, is off by less than one ulp of the
# result, and ulp(x) <= eps * |x| (eps = 2u, u the dtype's unit roundoff): rtol
# eps holds for round-to-nearest (<= u|x|) and for the Triton interpreter's
# truncating fp32 -> bf16 cast alike. atol is the fp32 merge's own error: the
# weights b^(lse_r - L) and their sum over W <= 8 terms of size <= 1 are a few
# dozen fp32 roundoffs off. Summing or rescaling in the 16-bit dtype rounds at
# the size of the terms, not of the result: where the terms cancel, the error
# is tens to hundreds of times this bound (the old "out" bound lets it pass).
FP32_MERGE_SLACK = 64 * torch.finfo(torch.float32).eps / 2  # 2^-18


def _rounded_once(dtype: torch.dtype) -> Tolerance:
    return Tolerance(atol=FP32_MERGE_SLACK, rtol=torch.finfo(dtype).eps)


FLOAT_TOLERANCES: dict[tuple[str, torch.dtype], Tolerance] = {
    ("out", torch.float32): Tolerance(atol=2e-6, rtol=2e-6),
    ("out", torch.float16): Tolerance(atol=1e-3, rtol=2e-3),
    ("out", torch.bfloat16): Tolerance(atol=8e-3, rtol=1.6e-2),
    ("out_rounded_once", torch.float16): _rounded_once(torch.float16),
    ("out_rounded_once", torch.bfloat16): _rounded_once(torch.bfloat16),
    ("lse", torch.float32): Tolerance(atol=1e-5, rtol=1e-6),
}

DIM_NAMES: dict[int, tuple[str, ...]] = {
    1: ("token",),
    2: ("token", "head"),
    3: ("token", "head", "dim"),
}


def coarser_dtype(*dtypes: torch.dtype | None) -> torch.dtype:
    """Of the given float dtypes, the one with the fewest mantissa bits."""
    present = [d for d in dtypes if d is not None]
    return max(present, key=lambda d: torch.finfo(d).eps)


def tolerance_for(quantity: str, dtype: torch.dtype) -> Tolerance:
    try:
        return FLOAT_TOLERANCES[(quantity, dtype)]
    except KeyError:
        known = ", ".join(f"{q}/{str(d).removeprefix('torch.')}" for q, d in FLOAT_TOLERANCES)
        raise KeyError(f"no tolerance for {quantity} in {dtype}; the table has: {known}") from None


# A merge that rounds each weighted term b^(lse_r - L) * out_r to a 16-bit
# dtype and sums the terms in it (vLLM's ag_rs: a 16-bit reduce-scatter), in
# whatever order, is off from the exact merge by at most
# gamma_(W-1) * sum_r |term_r| before its last rounding (gamma_n = n u / (1 - n u),
# u the unit roundoff: a term meets at most W - 1 roundings on its way to the
# last addition), plus that last rounding, <= u |result|, plus its fp32
# weights' error. A combine that rounds once is off by u |result| plus its own
# fp32 error. The "out" rtol (4.1 u) takes both roundings, against the exact
# merge or against each other; the rest must fit in atol (2.05 u). With weights
# summing to 1, sum_r |term_r| <= max_r |out_r|: bounding the partials bounds it.
FP32_WEIGHTS_ERROR = 2.0**-15  # relative, either combine: its fp32 weights (7.6e-6 at |LSE| = 150) and fp32 sum


def out_amplitude_summable_in(dtype: torch.dtype, world_size: int) -> float:
    """The largest power of two M <= 1 such that W partials with |out| <= M
    wherever they have weight, merged by weights summing to 1, stay within the
    "out" tolerance of the exact merge and of a merge rounded once, even when
    every weighted term and every partial sum is rounded to ``dtype``, in any
    order: 1, 1, 1/2, 1/4 at W = 1, 2, 4, 8 for fp16 and bf16."""
    tolerance = tolerance_for("out", dtype)
    u = torch.finfo(dtype).eps / 2
    if tolerance.rtol < 2 * u / (1 - 3 * u):
        raise ValueError(f"the out rtol in {dtype} does not take two roundings of the result")
    roundings = world_size - 1
    gamma = roundings * u / (1 - roundings * u)
    # Each of the 2W - 1 roundings may also lose half the smallest subnormal.
    underflow = (2 * world_size - 1) * torch.finfo(dtype).smallest_normal * u
    budget = tolerance.atol * (1 - 3 * u) - underflow
    error_per_amplitude = gamma * (1 + FP32_WEIGHTS_ERROR) + 2 * FP32_WEIGHTS_ERROR
    amplitude = 1.0
    while amplitude * error_per_amplitude > budget:
        amplitude /= 2
    return amplitude


def format_context(context: Mapping[str, Any] | None) -> str:
    """``stage=3 backend=a2a lse_base=e W=4 rank=1`` (keys in the caller's order)."""
    if not context:
        return ""
    return " ".join(f"{key}={value}" for key, value in context.items())


@dataclass(frozen=True)
class CloseStats:
    """Error statistics of one comparison (picklable; rank functions return them)."""

    max_abs_err: float
    worst_ratio: float  # worst |err| / allowed; <= 1 passes
    num_out_of_tolerance: int
    num_elements: int

    def as_dict(self) -> dict[str, float | int]:
        return {
            "max_abs_err": self.max_abs_err,
            "worst_ratio": self.worst_ratio,
            "num_out_of_tolerance": self.num_out_of_tolerance,
            "num_elements": self.num_elements,
        }


def _location(
    flat_index: int,
    shape: Sequence[int],
    dims: Sequence[str] | None,
    row_labels: Sequence[str] | None,
    offsets: Sequence[int] | None,
) -> str:
    """``(token=5 [decode, recent ids], head=2, dim=17)``; the label describes
    dim 0; ``offsets`` shift a slice's coordinates back to the full tensor."""
    names = tuple(dims) if dims is not None else DIM_NAMES.get(len(shape), ())
    if len(names) != len(shape):
        names = tuple(f"i{axis}" for axis in range(len(shape)))
    coords = []
    for size in reversed(shape):
        coords.append(flat_index % size)
        flat_index //= size
    coords.reverse()
    if offsets is not None:
        coords = [c + offset for c, offset in zip(coords, offsets)]
    parts = [f"{name}={c}" for name, c in zip(names, coords)]
    if parts and row_labels is not None and coords[0] < len(row_labels):
        parts[0] += f" [{row_labels[coords[0]]}]"
    return "(" + ", ".join(parts) + ")"


def _as_float64(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return x.detach().to(device, torch.float64)


def _as_canonical_lse(lse: torch.Tensor, device: torch.device) -> torch.Tensor:
    """float64 with every empty row (-inf, the sentinel, anything at or below
    the empty bound) set to exactly ``EMPTY_LSE``."""
    lse = _as_float64(lse, device)
    return torch.where(is_empty_lse(lse), torch.full_like(lse, EMPTY_LSE), lse)


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    what: str,
    context: Mapping[str, Any] | None = None,
    quantity: str = "out",
    tolerance: Tolerance | None = None,
    dtype: torch.dtype | None = None,
    dims: Sequence[str] | None = None,
    row_labels: Sequence[str] | None = None,
    offsets: Sequence[int] | None = None,
) -> CloseStats:
    """Raise :class:`MismatchError` unless ``actual`` is within tolerance of ``expected``.

    The tolerance comes from :data:`FLOAT_TOLERANCES` by ``quantity`` and
    ``dtype`` (the dtype the test asked for; by default that of ``actual``)
    unless given. NaN in ``actual`` is always out of
    tolerance; equal infinities match. The message names ``what``, the
    context, the worst element (location by ``dims``, default token/head/dim,
    with ``row_labels[token]`` when given, shifted by ``offsets`` when the
    tensors are a slice, e.g. ``(0, first_head, 0)`` for a rank's heads),
    actual vs expected there, and how many elements are out of tolerance.
    Returns the error statistics when it passes.
    """
    actual = _plain(actual)  # its dtype picks the tolerance
    tolerance = tolerance or tolerance_for(quantity, dtype or actual.dtype)
    return _check(actual, expected, _as_float64, tolerance, what, context, dims, row_labels, offsets)


def assert_lse_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    what: str,
    context: Mapping[str, Any] | None = None,
    dims: Sequence[str] | None = None,
    row_labels: Sequence[str] | None = None,
    offsets: Sequence[int] | None = None,
) -> CloseStats:
    """:func:`assert_close` for fp32 LSEs: every empty row counts as
    ``EMPTY_LSE`` on both sides, so -inf and -1e30 are the same answer; a
    finite LSE against an empty one is still a mismatch."""
    tolerance = tolerance_for("lse", torch.float32)
    return _check(actual, expected, _as_canonical_lse, tolerance, what, context, dims, row_labels, offsets)


def _check(actual, expected, prepare, tolerance, what, context, dims, row_labels, offsets) -> CloseStats:
    where = f"{what} ({format_context(context)})" if context else what
    actual, expected = _plain(actual), _plain(expected)
    if tuple(actual.shape) != tuple(expected.shape):
        raise MismatchError(f"{where}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    # On a GPU when either side is there: a realistic output is 10^8 elements, seconds of host float64
    # per comparison; IEEE float64 subtraction, abs and division give the same numbers on either device.
    device = actual.device if actual.device.type != "cpu" else expected.device
    got, want = prepare(actual, device), prepare(expected, device)
    abs_err = (got - want).abs()
    abs_err = torch.where(got == want, torch.zeros_like(abs_err), abs_err)  # equal infinities
    abs_err = torch.nan_to_num(abs_err, nan=math.inf)
    allowed = tolerance.atol + tolerance.rtol * want.abs().nan_to_num(posinf=0.0, neginf=0.0)
    ratio = abs_err / allowed
    num_elements = got.numel()
    stats = CloseStats(
        max_abs_err=abs_err.max().item() if num_elements else 0.0,
        worst_ratio=ratio.max().item() if num_elements else 0.0,
        num_out_of_tolerance=int((ratio > 1).sum()),
        num_elements=num_elements,
    )
    if not stats.num_out_of_tolerance:
        return stats

    worst = int(ratio.flatten().argmax())
    raise MismatchError(
        f"{where}: {stats.num_out_of_tolerance} of {num_elements} elements out of tolerance "
        f"({tolerance.describe()}, {str(actual.dtype).removeprefix('torch.')}).\n"
        f"  worst at {_location(worst, actual.shape, dims, row_labels, offsets)}: "
        f"actual {got.flatten()[worst].item():.8g}, expected {want.flatten()[worst].item():.8g}, "
        f"abs err {abs_err.flatten()[worst].item():.3g} (allowed {allowed.flatten()[worst].item():.3g}); "
        f"max abs err {stats.max_abs_err:.3g}; NaN in actual: {int(torch.isnan(got).sum())}"
    )
