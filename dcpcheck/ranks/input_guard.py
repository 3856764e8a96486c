"""Capabilities read their inputs and nothing more: one that changes a tensor
it was given (the partials in ``combine``, the top-k or the block table in
``filter_index``) fails the case saying so, naming the capability, the
argument, the rank and how many elements changed, instead of a mismatch
blamed on its output or on the oracle.

While a case runs, every capability of the implementation object (and the
``forward`` and ``plan_step`` of each layer its ``build_attention`` returns)
is shadowed on the instance by a wrapper that copies its tensor arguments
before the call and compares them after it. Only what :data:`MAY_WRITE`
names may change. A violation is recorded, not raised: the case goes on (no
peer is left waiting in a collective), and the rank fails at its end, this
first. Tensors over :data:`MAX_CHECKED_BYTES` (a 4 GiB cache) are not copied,
so not checked; nor is anything during CUDA graph capture.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from dcpcheck.impls.protocol import CAPABILITIES, DcpImplementation

# What a call may write of its arguments (the contract's sections 5.3, 5.4):
# prefill_remap its top-k ("in place": slot k for id k), a layer's forward the
# caches it writes the step's window rows and completed states to.
MAY_WRITE: dict[str, frozenset[str]] = {
    "prefill_remap": frozenset({"topk"}),
    "forward": frozenset({"swa_cache", "comp_cache"}),
}
WRITERS_NAMED = "only prefill_remap may write its topk, and a layer's forward its swa_cache and comp_cache"
MAX_CHECKED_BYTES = 1 << 26  # 64 MiB
LAYER_METHODS = ("plan_step", "forward")
# The original of a wrapper, so that a second guard (a case after an abandoned one) wraps it, not the wrapper.
UNGUARDED = "_dcpcheck_unguarded"


class InputChangedError(AssertionError):
    """A capability changed a tensor its contract says it only reads."""


def _contract_signature(name: str) -> inspect.Signature | None:
    """The protocol's signature of capability ``name``, without ``self``: the
    contract's argument names, whatever the implementation calls them."""
    method = getattr(DcpImplementation, name, None)
    if method is None:
        return None
    signature = inspect.signature(method)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def _signature_of(fn) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _named_arguments(signature: inspect.Signature | None, args: tuple, kwargs: dict) -> list[tuple[str, object]]:
    """(name, value) of every argument of a call, by the signature when it binds."""
    try:
        bound = signature.bind(*args, **kwargs)
    except (AttributeError, TypeError):  # no signature, or a call it does not fit
        return [(f"argument {i + 1}", value) for i, value in enumerate(args)] + list(kwargs.items())
    named = []
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named += list(value.items())
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            named += [(f"{name}[{i}]", item) for i, item in enumerate(value)]
        else:
            named.append((name, value))
    return named


def _checkable(value) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.layout == torch.strided
        and value.device.type != "meta"
        and value.numel() * value.element_size() <= MAX_CHECKED_BYTES
        and not (value.is_cuda and torch.cuda.is_current_stream_capturing())
    )


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """A float tensor as integers of its size (NaN equals NaN bit for bit); any other tensor as it is."""
    as_int = _INT_OF_SIZE.get(tensor.element_size())
    return tensor.view(as_int) if tensor.is_floating_point() and as_int is not None else tensor


def _changed_elements(before: torch.Tensor, after: torch.Tensor) -> str | None:
    """How ``after`` differs from ``before`` (NaN where NaN was is unchanged), or None."""
    after = after.detach()
    if after.shape != before.shape:
        return f"resized from {list(before.shape)} to {list(after.shape)}"
    if torch.equal(as_bits(before), as_bits(after)):  # the common case, in one pass, NaNs included
        return None
    differ = before != after
    if before.is_floating_point() or before.is_complex():
        differ &= ~(before.isnan() & after.isnan())
    changed = int(differ.sum())
    return f"{changed} of {before.numel()} elements" if changed else None


class InputGuard:
    """The violations one case's calls recorded, on one rank."""

    def __init__(self, rank: int):
        self.rank = rank
        self.violations: list[str] = []
        self.active = True

    def wrap(self, what: str, fn, signature: inspect.Signature | None, may_write: frozenset[str]):
        original = getattr(fn, UNGUARDED, fn)

        def checking_inputs(*args, **kwargs):
            if not self.active:
                return original(*args, **kwargs)
            named = _named_arguments(signature, args, kwargs)
            copies = [
                (name, value, value.detach().clone())
                for name, value in named
                if name not in may_write and _checkable(value)
            ]
            result = original(*args, **kwargs)
            for name, value, before in copies:
                how = _changed_elements(before, value)
                if how is not None:
                    self.violations.append(f"{what} changed its input `{name}` in place (rank {self.rank}, {how})")
            if what == "build_attention":
                self._guard_layer(result)
            return result

        setattr(checking_inputs, UNGUARDED, original)
        return checking_inputs

    def _guard_layer(self, layer) -> None:
        """The layer's own methods too (a layer outlives no case's guard: its wrappers pass through after it)."""
        for method in LAYER_METHODS:
            fn = getattr(layer, method, None)
            if callable(fn):
                try:
                    setattr(layer, method, self.wrap(method, fn, _signature_of(fn), MAY_WRITE.get(method, frozenset())))
                except (AttributeError, TypeError):  # a layer whose attributes cannot be set is not checked
                    pass

    def error(self) -> str:
        shown = self.violations[:8]
        more = f"; and {len(self.violations) - len(shown)} more" if len(self.violations) > len(shown) else ""
        return (
            f"[rank {self.rank}] InputChangedError: {'; '.join(shown)}{more}: its contract says it only reads its "
            f"inputs ({WRITERS_NAMED})"
        )


@contextmanager
def inputs_read_only(impl, rank: int) -> Iterator[InputGuard]:
    """Within the block, every capability of ``impl`` records changes of its
    inputs in the guard yielded; the instance is as it was afterwards."""
    guard = InputGuard(rank)
    shadowed = {}
    for name in CAPABILITIES:
        fn = getattr(impl, name, None)
        if not callable(fn):
            continue
        try:
            had_own = name in vars(impl)
        except TypeError:  # no __dict__ (slots): not checked
            continue
        try:
            setattr(impl, name, guard.wrap(name, fn, _contract_signature(name), MAY_WRITE.get(name, frozenset())))
        except (AttributeError, TypeError):  # a read-only attribute: not checked
            continue
        shadowed[name] = (had_own, getattr(fn, UNGUARDED, fn))
    try:
        yield guard
    finally:
        guard.active = False
        for name, (had_own, original) in shadowed.items():
            if had_own:
                setattr(impl, name, original)
            else:
                delattr(impl, name)
