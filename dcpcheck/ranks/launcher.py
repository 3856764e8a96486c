"""What the plugin needs of a way to launch ranks: one case (its whole input),
the result of one case on every rank, and the :class:`Launcher` interface that both launchers implement
(the spawned pools of plain pytest, :mod:`dcpcheck.ranks.spawned`, and the
in-process ranks of torchrun, :mod:`dcpcheck.ranks.torchrun`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from dcpcheck.impls.protocol import CaseTerms

Answer = TypeVar("Answer")

# After one rank has failed, how long its peers get to finish before they are
# declared stuck (waiting in a collective the failed rank never joined).
PEER_GRACE_S = 1.5
# A rank's collectives time out this long after the case timeout, so that a
# stuck case is ended by the launcher (which reads every stuck rank's stack),
# not by a rank's collective raising first.
COLLECTIVE_TIMEOUT_GRACE_S = 30.0


class LaunchError(RuntimeError):
    """The ranks could not be started or could not form their group."""


@dataclass(frozen=True)
class Case:
    """One run of a rank function on ``world_size`` ranks, built by the plugin
    before launch: the launcher's whole input besides the function, and what
    a rank knows of its case (``ctx.case``)."""

    nodeid: str  # the test's node id, alike on every rank
    stage: int | None  # the test's stage marker (None: a harness test)
    world_size: int
    seed: int
    timeout: float  # ranks still running this long after the start are stuck
    params: dict[str, Any]  # the rank function's keyword arguments
    terms: CaseTerms  # the case in the contract's terms, as the implementation was asked about it
    header: dict[str, Any]  # what every failure message of the case opens with (stage, W, device, ...)
    # GiB each GPU of the case must have free: its gpu_memory marker's need (0: unmarked).
    gpu_gib_needed: float = 0.0
    cures: tuple[str, ...] = ()  # the known defects' causes the implementation neutralises in this run
    # A run that only has to show its known defect, whose cured run checks the rest: a long check may end at
    # its first failure.
    first_failure_suffices: bool = False

    def describe(self) -> str:
        """The header as one line: ``stage=... | W=... | ... | seed=...``."""
        return " | ".join(f"{key}={value}" for key, value in self.header.items())


@dataclass
class CaseResult:
    """What came back from one case on every rank."""

    world_size: int
    outcomes: dict = field(default_factory=dict)  # rank -> RankOutcome
    stuck: dict = field(default_factory=dict)  # rank -> Python stacks
    dead: dict = field(default_factory=dict)  # rank -> how it died (+ log tail)
    silent: dict = field(default_factory=dict)  # rank -> why it sent no report (torchrun: no process to watch)
    timed_out: bool = False
    seconds: float = 0.0
    # Set when no later case can run on these ranks (torchrun: a rank is gone
    # or wedged): the session stops after this test, saying why.
    stop_session: str | None = None
    # The start-up of the pool this case had to start first (RankPool.startup), and how many idle pools were
    # ended first to free GPU memory for it (idle_pools_ended), and how long it waited for its declared GPU memory
    # (gpu_ledger_wait_s); else empty.
    pool_startup: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (
            not self.stuck
            and not self.dead
            and not self.silent
            and len(self.outcomes) == self.world_size
            and all(o.ok for o in self.outcomes.values())
        )


class Launcher(Protocol):
    def decide_before_launch(self, case: Case, ask: Callable[[], Answer]) -> Answer:
        """``ask()`` (the implementation's answers before ``case``), the same
        on every rank: asked once, here or on one rank and shared, before any
        collective, so that no rank skips a case its peers run. ``ask`` bounds
        each of its calls by ``case.timeout``. Raises :class:`LaunchError` when
        the answers never came."""
        ...

    def run(self, fn, case: Case) -> CaseResult:
        """Run ``fn(ctx, **case.params)`` on ``case.world_size`` ranks with the
        implementation the launcher was made for; ranks still running
        ``case.timeout`` seconds later are stuck. Raises :class:`LaunchError`
        when the ranks cannot start."""
        ...

    def stop(self) -> None:
        """End every rank process and process group this launcher started."""
        ...
