"""Process-local patches for rank functions: spies on an implementation's
capability and on direct ``torch.distributed`` collectives, and environment
variables set for the implementation.

Each patches the calling process only and restores on exit, so it is safe
under the spawned pool (one process per rank) and under torchrun (the rank
function runs inside pytest).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# Every torch.distributed entry point that talks to peers.
COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
)


@dataclass
class CallLog:
    """What a spy saw: one entry per call, in order."""

    calls: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.calls)


@contextmanager
def spy_on_capability(impl, name: str) -> Iterator[CallLog]:
    """Record ``(args, kwargs)`` of every call of ``impl.<name>`` made through
    the object (its layers included), by shadowing it on the instance."""
    original = getattr(impl, name)
    shadowed = name in vars(impl)
    log = CallLog()

    def recording(*args, **kwargs):
        log.calls.append((args, kwargs))
        return original(*args, **kwargs)

    setattr(impl, name, recording)
    try:
        yield log
    finally:
        if shadowed:
            setattr(impl, name, original)
        else:
            delattr(impl, name)


@contextmanager
def spy_on_collectives() -> Iterator[CallLog]:
    """Record ``(collective name, shapes of its tensor arguments)`` of every
    direct ``torch.distributed`` collective."""
    log = CallLog()
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def recording(name, original):
        def call(*args, **kwargs):
            shapes = [tuple(a.shape) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            log.calls.append((name, shapes))
            return original(*args, **kwargs)

        return call

    for name, original in originals.items():
        setattr(dist, name, recording(name, original))
    try:
        yield log
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


@contextmanager
def environment(name: str, value: str | None) -> Iterator[None]:
    """``os.environ[name] = value`` (None: unset) inside the block only, so a
    test decides what the implementation reads whatever the session's env."""
    before = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextmanager
def environments(values: Mapping[str, str | None]) -> Iterator[None]:
    """:func:`environment` for several variables at once."""
    with ExitStack() as stack:
        for name, value in values.items():
            stack.enter_context(environment(name, value))
        yield
