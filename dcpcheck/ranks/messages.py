"""The messages between a spawned pool (:mod:`dcpcheck.ranks.pool`) and its
processes (:mod:`dcpcheck.ranks.worker`), one class each, sent pickled over
each process's connection. A rank answers a :class:`RunCase` with
:class:`CaseStarted`, then its :class:`~dcpcheck.ranks.rankfn.RankOutcome`."""

from __future__ import annotations

from dataclasses import dataclass

from dcpcheck.ranks.launcher import Case


@dataclass(frozen=True)
class ZygoteHello:
    """The zygote's first message: from now on it reports each rank's exit."""

    pid: int


@dataclass(frozen=True)
class RankHello:
    """A rank's first message, as soon as it connected: which rank it is."""

    rank: int
    pid: int


@dataclass(frozen=True)
class RankFailedToStart:
    """A rank's group set-up raised: its error, for the test's message;
    ``out_of_memory``: the error says its device had no memory left (CUDA's
    context, NCCL's buffers), which the pool's owner may free and try again."""

    rank: int
    error: str
    out_of_memory: bool = False


@dataclass(frozen=True)
class RankReady:
    """A rank joined its group; ``startup``: the seconds of its set-up, per
    phase (cuda_init_s, group_init_s)."""

    rank: int
    pid: int
    startup: dict[str, float]


@dataclass(frozen=True)
class RankExited:
    """From the zygote: a rank's process ended with ``code`` (negative: the
    signal that killed it)."""

    rank: int
    code: int


@dataclass(frozen=True)
class RunCase:
    """To every rank: run the pickled rank function ``fn`` on ``case``, with
    the pytest process's ``sys_path`` (test modules import from it)."""

    fn: bytes
    case: Case
    sys_path: list[str]


@dataclass(frozen=True)
class CaseStarted:
    """A rank's first answer to a :class:`RunCase`: a rank that dies before
    sending it died between cases, not in the case."""


@dataclass(frozen=True)
class Stop:
    """To every rank: leave the group and exit."""
