"""Capabilities read their inputs and nothing more: one that changes a tensor
it was given (the partials in ``combine``, the top-k or the block table in
``filter_index``), or the storage beyond the view it was given, fails the
case saying so, naming the capability, the argument, the rank and how much
changed, instead of a mismatch blamed on its output or on the oracle.

While a case runs, every capability of the implementation object (and the
``forward`` and ``plan_step`` of each layer its ``build_attention`` returns)
is shadowed by a wrapper that copies the storage of its tensor arguments
before the call and compares it, bit for bit, after it. Only what
:data:`MAY_WRITE` names may change. A change is recorded, and raised as the
call returns: the rank fails at once (a peer that fails first cannot leave it
stuck in a collective with its report unsent), and still fails at the case's
end if the rank function catches it. Storage over :data:`MAX_CHECKED_BYTES`
(a 4 GiB cache) is not copied (only the view's own span, when that fits), so
not checked; nor is anything during CUDA graph capture. An object whose
methods cannot be shadowed fails the case naming it, never unchecked.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from dcpcheck.impls.protocol import CAPABILITIES, DcpImplementation
from dcpcheck.plain_tensors import plain_over

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
# The original of a wrapper (or of a guarded class), so that a second guard (a
# case after an abandoned one) wraps the original, not the wrapper.
UNGUARDED = "_dcpcheck_unguarded"


class InputChangedError(AssertionError):
    """A capability changed a tensor its contract says it only reads."""


class NotInstrumentable(Exception):
    """An object whose methods the check cannot put its wrappers in front of."""


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


# ---- reading tensors without their own methods ------------------------------
# Everything the check reads of an argument goes through these: a tensor
# subclass's __torch_function__ (one that claims every comparison equal) never
# runs, and what is compared is a plain tensor over the same bytes
# (dcpcheck.plain_tensors, through which the output comparison reads too).


def _plain_view(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor over the elements ``tensor`` views now."""
    with torch._C.DisableTorchFunctionSubclass():
        return plain_over(
            tensor.untyped_storage(), tensor.dtype, tensor.storage_offset(), tensor.shape, tensor.stride()
        )


def _bytes(storage: torch.UntypedStorage, span: tuple[int, int]) -> torch.Tensor:
    return plain_over(storage, torch.uint8, span[0], (span[1] - span[0],), (1,))


def _checkable(value) -> bool:
    with torch._C.DisableTorchFunctionSubclass():
        return (
            isinstance(value, torch.Tensor)
            and value.layout == torch.strided
            and value.device.type != "meta"
            and not (value.is_cuda and torch.cuda.is_current_stream_capturing())
        )


def _view_extent(view: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage from the view's first element to its last."""
    start = view.storage_offset() * view.element_size()
    if view.numel() == 0:
        return start, start
    last = sum((size - 1) * step for size, step in zip(view.shape, view.stride()))
    return start, start + (last + 1) * view.element_size()


def _span(view: torch.Tensor) -> tuple[int, int] | None:
    """What to copy of the view's storage: all of it (a write anywhere the
    call can reach is seen), else the view's own extent, if either fits."""
    whole = (0, view.untyped_storage().nbytes())
    for span in (whole, _view_extent(view)):
        if span[1] - span[0] <= MAX_CHECKED_BYTES:
            return span
    return None


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """A float tensor as integers of its size (NaN equals NaN bit for bit); any other tensor as it is."""
    as_int = _INT_OF_SIZE.get(tensor.element_size())
    return tensor.view(as_int) if tensor.is_floating_point() and as_int is not None else tensor


def _changed_elements(before: torch.Tensor, after: torch.Tensor) -> str | None:
    """How plain tensor ``after`` differs from ``before`` (NaN where NaN was is unchanged), or None."""
    if after.shape != before.shape:
        return f"resized from {list(before.shape)} to {list(after.shape)}"
    if torch.equal(as_bits(before), as_bits(after)):  # the common case, in one pass, NaNs included
        return None
    differ = before != after
    if before.is_floating_point() or before.is_complex():
        differ &= ~(before.isnan() & after.isnan())
    changed = int(differ.sum())
    return f"{changed} of {before.numel()} elements" if changed else None


@dataclass
class _Snapshot:
    """One argument before the call: the bytes of its storage it could reach, and where its view lay in them."""

    name: str
    value: torch.Tensor  # the argument, as the caller holds it
    dtype: torch.dtype
    storage: torch.UntypedStorage
    span: tuple[int, int]
    saved: torch.Tensor  # uint8 copy of storage[span]
    geometry: tuple  # (storage offset, shape, stride) of the view
    whole_storage_read_only: bool  # False where a writable argument shares the storage

    def before(self) -> torch.Tensor:
        """The view's elements as they were, over the copy."""
        offset, shape, stride = self.geometry
        start = offset - self.span[0] // self.dtype.itemsize
        return plain_over(self.saved.untyped_storage(), self.dtype, start, shape, stride)

    def changes(self) -> str | None:
        """How the call changed what this argument can reach, or None."""
        if self.storage.nbytes() < self.span[1]:
            return f"its storage shrunk from {self.span[1]} to {self.storage.nbytes()} bytes"
        now = _plain_view(self.value)
        unmoved = now.untyped_storage().data_ptr() == self.storage.data_ptr() and self.geometry == (
            now.storage_offset(),
            now.shape,
            now.stride(),
        )
        current = _bytes(self.storage, self.span)
        if unmoved and torch.equal(self.saved, current):  # the common case, in one pass
            return None
        found = [_changed_elements(self.before(), now)]
        if self.whole_storage_read_only:
            found.append(self._outside_the_view(current))
        return "; ".join(how for how in found if how) or None

    def _outside_the_view(self, current: torch.Tensor) -> str | None:
        differ = self.saved != current
        offset, shape, stride = self.geometry
        size = self.dtype.itemsize
        covered = differ.as_strided(
            (*shape, size), (*(step * size for step in stride), 1), offset * size - self.span[0]
        )
        covered.fill_(False)  # the view's own bytes are compared element by element
        changed = int(differ.sum())
        return f"{changed} bytes of its storage outside the view it was given" if changed else None


def _snapshots(named: list[tuple[str, object]], may_write: frozenset[str]) -> list[_Snapshot]:
    tensors = [(name, _plain_view(value), value) for name, value in named if _checkable(value)]
    written = {view.untyped_storage().data_ptr() for name, view, _ in tensors if name in may_write}
    snapshots = []
    for name, view, value in tensors:
        span = _span(view) if name not in may_write else None
        if span is None:
            continue
        storage = view.untyped_storage()
        geometry = (view.storage_offset(), view.shape, view.stride())
        saved = _bytes(storage, span).clone()
        shared = storage.data_ptr() in written
        snapshots.append(_Snapshot(name, value, view.dtype, storage, span, saved, geometry, not shared))
    return snapshots


# ---- putting wrappers in front of an object's methods -----------------------


def _instance_dict(obj) -> dict | None:
    try:
        own = object.__getattribute__(obj, "__dict__")
    except AttributeError:  # __slots__
        return None
    return own if type(own) is dict else None


def _is_data_descriptor(cls: type, name: str) -> bool:
    """A class attribute an instance attribute cannot shadow (a property)."""
    found = inspect.getattr_static(cls, name, None)
    return hasattr(type(found), "__set__") or hasattr(type(found), "__delete__")


def _guarded_class(cls: type, wrappers: dict[str, Callable]) -> type:
    """A subclass of ``cls`` with the wrappers as its methods, of the same layout (``__slots__ = ()``)."""
    namespace = {name: staticmethod(wrapper) for name, wrapper in wrappers.items()}
    namespace.update(__slots__=(), __module__=cls.__module__, __qualname__=cls.__qualname__, **{UNGUARDED: cls})
    return type(cls)(cls.__name__, (cls,), namespace)


def _shadow(obj, wrappers: dict[str, Callable]) -> Callable[[], None]:
    """Put each wrapper where ``obj.<name>`` finds it, past any ``__setattr__``
    of the object's class (a frozen dataclass's, or one that ignores
    assignments): in the object's own ``__dict__``, else, for ``__slots__``
    or a property, in a subclass the object is switched to. -> what puts
    the object back; raises :class:`NotInstrumentable` (the object as it was)."""
    own = _instance_dict(obj)
    cls = vars(type(obj)).get(UNGUARDED, type(obj))  # below the class of an abandoned case's guard
    in_dict = {n: w for n, w in wrappers.items() if own is not None and not _is_data_descriptor(cls, n)}
    on_class = {n: w for n, w in wrappers.items() if n not in in_dict}
    originals = {name: own[name] for name in in_dict if name in own}

    def put_back() -> None:
        for name in in_dict:
            if name in originals:
                own[name] = getattr(originals[name], UNGUARDED, originals[name])
            else:
                own.pop(name, None)
        if type(obj) is not cls:
            object.__setattr__(obj, "__class__", cls)

    try:
        if own is not None:
            own.update(in_dict)
        if on_class:
            object.__setattr__(obj, "__class__", _guarded_class(cls, on_class))
        unread = [name for name, wrapper in wrappers.items() if _read(obj, name) is not wrapper]
    except Exception as exc:  # noqa: BLE001 - a class refusing a subclass, or its __class__ being set
        put_back()
        raise NotInstrumentable(f"shadowing its methods raised {type(exc).__name__}: {exc}") from None
    if unread:
        put_back()
        raise NotInstrumentable(
            f"`{'`, `'.join(unread)}` read back as another object than the wrapper put in its place "
            "(its class decides what an attribute read finds)"
        )
    return put_back


def _read(obj, name: str):
    try:
        return getattr(obj, name)
    except Exception:  # noqa: BLE001 - the implementation's own __getattribute__ / __getattr__
        return None


class InputGuard:
    """What one case's calls did to their inputs, on one rank."""

    def __init__(self, rank: int):
        self.rank = rank
        self.changes: list[str] = []  # inputs a call changed
        self.unchecked: list[str] = []  # objects whose calls could not be wrapped
        self.active = True

    @property
    def violations(self) -> list[str]:
        """Everything that fails the rank."""
        return self.changes + self.unchecked

    def wrap(self, what: str, fn, signature: inspect.Signature | None, may_write: frozenset[str]):
        original = getattr(fn, UNGUARDED, fn)

        def checking_inputs(*args, **kwargs):
            if not self.active:
                return original(*args, **kwargs)
            snapshots = _snapshots(_named_arguments(signature, args, kwargs), may_write)
            result = original(*args, **kwargs)
            changed = [
                f"{what} changed its input `{snapshot.name}` in place (rank {self.rank}, {how})"
                for snapshot in snapshots
                if (how := snapshot.changes()) is not None
            ]
            if changed:
                self.changes += changed
                raise InputChangedError(f"raised as {what} returned (the case stops here on this rank)")
            if what == "build_attention":
                self._guard_layer(result)
            return result

        setattr(checking_inputs, UNGUARDED, original)
        return checking_inputs

    def wrappers(self, obj, names, signature_of) -> dict[str, Callable]:
        """A wrapper for each method of ``obj`` among ``names``."""
        found = {name: _read(obj, name) for name in names}
        return {
            name: self.wrap(name, fn, signature_of(name, fn), MAY_WRITE.get(name, frozenset()))
            for name, fn in found.items()
            if callable(fn)
        }

    def shadow(self, obj, wrappers: dict[str, Callable]) -> Callable[[], None]:
        """:func:`_shadow`; an object that cannot be is recorded, and put back as it was."""
        try:
            return _shadow(obj, wrappers)
        except NotInstrumentable as why:
            self.unchecked.append(f"the calls of {type(obj).__name__} cannot be checked: {why}")
            return lambda: None

    def _guard_layer(self, layer) -> None:
        """The layer's own methods too (a layer outlives no case's guard: its wrappers pass through after it)."""
        self.shadow(layer, self.wrappers(layer, LAYER_METHODS, lambda name, fn: _signature_of(fn)))

    def error(self) -> str:
        lines = []
        if self.changes:
            shown = self.changes[:8]
            more = f"; and {len(self.changes) - len(shown)} more" if len(self.changes) > len(shown) else ""
            lines.append(
                f"[rank {self.rank}] InputChangedError: {'; '.join(shown)}{more}: its contract says it only reads "
                f"its inputs ({WRITERS_NAMED})"
            )
        if self.unchecked:
            lines.append(
                f"[rank {self.rank}] InputCheckError: {'; '.join(self.unchecked)}: the suite checks that each "
                "capability only reads its inputs by wrapping its methods; give it methods an attribute read finds "
                "(plain methods, or attributes of the object)"
            )
        return "\n".join(lines)


@contextmanager
def inputs_read_only(impl, rank: int) -> Iterator[InputGuard]:
    """Within the block, every capability of ``impl`` records changes of its
    inputs in the guard yielded; the object is as it was afterwards."""
    guard = InputGuard(rank)
    put_back = guard.shadow(impl, guard.wrappers(impl, CAPABILITIES, lambda name, fn: _contract_signature(name)))
    try:
        yield guard
    finally:
        guard.active = False
        put_back()
