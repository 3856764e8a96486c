"""Running one case of a rank function on one rank: the protocol shared by
the spawned pool and the in-process torchrun mode.

A rank function is a module-level function ``fn(ctx, **params)``; it raises on
failure and may return a small picklable value (stats for the summary).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from dcpcheck import triton_interpreter
from dcpcheck.group import DcpGroup
from dcpcheck.ranks import compile_clock
from dcpcheck.ranks.case_state import LEFT_BY_LAST_CASE, CaseState
from dcpcheck.ranks.input_guard import inputs_read_only
from dcpcheck.ranks.launcher import Case


@dataclass
class RankContext:
    """What a rank function gets: its group, its device, the implementation
    and its case (node id, stage, seed, parameters, terms, header)."""

    group: DcpGroup
    device: torch.device
    impl: Any
    case: Case

    @property
    def rank(self) -> int:
        return self.group.rank_in_group

    @property
    def world_size(self) -> int:
        return self.group.world_size

    @property
    def seed(self) -> int:
        return self.case.seed

    def failure_context(self, **details) -> dict:
        """What a failure message of this rank names: the case's stage and W,
        this rank, then ``details`` (in the caller's order)."""
        return {"stage": self.case.stage, "W": self.world_size, "rank": self.rank, **details}

    def generator(self, offset: int = 0) -> torch.Generator:
        """A CPU generator seeded identically on every rank (build global
        inputs with it, then move them to ``ctx.device``)."""
        return torch.Generator().manual_seed(self.seed + offset)


@dataclass
class RankOutcome:
    rank: int
    ok: bool
    error: str = ""  # "ExcType: message" + traceback, for a failed rank
    value: Any = None
    seconds: float = 0.0
    gpu: str | None = None  # the rank's GPU ("cuda:0"), None on CPU
    gpu_peak_bytes: int = 0  # the most the case's allocator held on it at once
    compile_seconds: float = 0.0  # of ``seconds``, spent compiling Triton kernels (CUDA only)
    # this process's vectorised kernels sent back to the shipped run so far, each "kernel: why"
    interpreter_fallbacks: tuple[str, ...] = ()


# At most this much of one rank's error text reaches the failure message (a
# rank function's exception can be megabytes); the head and the tail are kept.
MAX_ERROR_CHARS = 64 * 1024
# Exceptions that end a process rather than fail a call: raised by a rank
# function, they leave the case early, and are reported as such.
LEAVING = (SystemExit, KeyboardInterrupt, GeneratorExit)


def bounded(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    if len(text) <= limit:
        return text
    keep = limit // 2
    return f"{text[:keep]}\n... [{len(text) - 2 * keep} characters cut] ...\n{text[-keep:]}"


def describe_exception(exc: BaseException, *, of_rank_function: bool = True) -> str:
    """``ExcType: message``, even when the exception's ``str()`` raises;
    ``of_rank_function``: one that ends a process says it left the case early."""
    try:
        message = str(exc)
    except BaseException as inner:  # noqa: BLE001 - a hostile __str__ must not hide the failure
        message = f"<str() of the exception raised {type(inner).__name__}>"
    if of_rank_function and isinstance(exc, LEAVING):
        message = f"{message} (the rank function left the case early by raising {type(exc).__name__})"
    return f"{type(exc).__name__}: {message}"


def format_rank_error(rank: int, exc: BaseException) -> str:
    """``[rank r]`` first, then the exception, then where it came from."""
    try:
        frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
    except BaseException:  # noqa: BLE001 - formatting runs the exception's own code
        frames = traceback.format_tb(exc.__traceback__)
    head = f"[rank {rank}] {bounded(describe_exception(exc), MAX_ERROR_CHARS // 4)}"
    lines = "".join(f"[rank {rank}] {line}" for chunk in frames for line in chunk.splitlines(True))
    return bounded(head + "\n" + lines)


def _leak_error(rank: int, leaked: list[str]) -> str:
    return (
        f"[rank {rank}] LeakedStateError: the case changed process-wide state that later cases on these ranks "
        f"would inherit (undone now): {'; '.join(leaked)}; change it inside a with-block, or put it back"
    )


def _release_gpu_memory(device: torch.device) -> tuple[str, int]:
    """-> (the GPU, the case's peak of memory reserved by the allocator, which
    is what the GPU had to hold); then give the allocator's cache back, so that
    the next case, and the pools of other world sizes sharing this GPU, find
    it free."""
    peak = torch.cuda.max_memory_reserved(device)
    gc.collect()  # tensors held only by reference cycles of the case
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return str(device), peak


class CureSwallowedError(RuntimeError):
    """The implementation's ``cured()`` context manager swallowed the case's error."""


def _cured(impl, cures: tuple[str, ...]):
    """The implementation with the causes of the case's cured known defects neutralised (none: as it is)."""
    return impl.cured(cures) if cures else contextlib.nullcontext()


def _call(fn, ctx: RankContext):
    """``fn(ctx, **params)`` under the case's cures; an error the cure's
    ``__exit__`` swallows (it returned True) is raised again, named."""
    raised = []
    with _cured(ctx.impl, ctx.case.cures):
        try:
            return fn(ctx, **ctx.case.params)
        except BaseException as exc:
            raised.append(exc)
            raise
    raise CureSwallowedError(
        f"the implementation's cured({', '.join(ctx.case.cures)}) swallowed the case's error "
        f"({describe_exception(raised[0])}): its __exit__ returned True; a cure must let the case's errors through"
    ) from raised[0]


def _run(fn, ctx: RankContext, state: CaseState) -> RankOutcome:
    start = time.perf_counter()
    try:
        value = _call(fn, ctx)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
    except BaseException as exc:  # noqa: BLE001 - every way out of a rank function is reported, with its rank
        error = format_rank_error(ctx.rank, exc)
        leaked = state.leaks()
        if leaked:
            error += "\n" + _leak_error(ctx.rank, leaked)
        return RankOutcome(ctx.rank, False, error, None, time.perf_counter() - start)
    leaked = state.leaks()
    if leaked:
        return RankOutcome(ctx.rank, False, _leak_error(ctx.rank, leaked), value, time.perf_counter() - start)
    return RankOutcome(ctx.rank, True, "", value, time.perf_counter() - start)


def _left_error(rank: int, previous: str, leaked: list[str]) -> str:
    return (
        f"[rank {rank}] LeakedStateError: process-wide state changed after the previous case on these ranks "
        f"({previous}) ended, before this one began (a thread that case left running, or code it left to run at "
        f"idle): {'; '.join(leaked)}; undone before this case ran; {previous} leaked it, not this case"
    )


def run_rank_case(fn, ctx: RankContext) -> RankOutcome:
    if ctx.device.type == "cuda":  # on CPU the kernels are interpreted: nothing compiles
        compile_clock.install()
    compiled_before = compile_clock.seconds()
    # The warnings filters only where the case runs in the main thread (a spawned rank's): under
    # torchrun that thread is pytest's, whose warnings plugin sets each test's filters.
    leaked_between = LEFT_BY_LAST_CASE.changed_since(
        ctx.group, warnings_filters=threading.current_thread() is threading.main_thread()
    )
    previous = LEFT_BY_LAST_CASE.nodeid
    with inputs_read_only(ctx.impl, ctx.rank) as guard:
        outcome = _run(fn, ctx, CaseState(ctx.seed, ctx.group))
    LEFT_BY_LAST_CASE.remember(ctx.case.nodeid, ctx.group)
    if guard.violations:  # first: a mismatch after it is likely its consequence
        outcome.ok = False
        outcome.error = guard.error() + ("\n" + outcome.error if outcome.error else "")
    if leaked_between:  # before all: what this case found was not the known state
        outcome.ok = False
        outcome.error = _left_error(ctx.rank, previous, leaked_between) + (
            "\n" + outcome.error if outcome.error else ""
        )
    outcome.compile_seconds = compile_clock.seconds() - compiled_before
    outcome.interpreter_fallbacks = triton_interpreter.fallbacks()
    if ctx.device.type == "cuda":
        outcome.gpu, outcome.gpu_peak_bytes = _release_gpu_memory(ctx.device)
    return outcome
