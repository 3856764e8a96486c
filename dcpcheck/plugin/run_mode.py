"""How the session's ranks run, chosen once at start-up: a spawned pool per
world size (plain pytest), or this process as one rank of torchrun's world.
Every difference between the two modes that the plugin sees is a method here."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import pytest

from dcpcheck.ranks.launcher import Launcher, LaunchError
from dcpcheck.ranks.placement import Placement


@dataclass(frozen=True)
class RunMode:
    """``torchrun_world_size``: the world torchrun launched, or None for the
    spawned pools; ``torchrun_rank``: this process's rank in it."""

    torchrun_world_size: int | None = None
    torchrun_rank: int = 0

    @classmethod
    def detect(cls, environ=os.environ) -> RunMode:
        from dcpcheck.ranks.torchrun import launched_by_torchrun, launcher_rank, launcher_world_size

        if launched_by_torchrun(environ):
            return cls(launcher_world_size(environ), launcher_rank(environ))
        return cls()

    @property
    def name(self) -> str:
        return "torchrun" if self.torchrun_world_size else "spawned pool"

    @property
    def reports(self) -> bool:
        """Whether this process writes the terminal report and the JUnit file
        (under torchrun only rank 0 does; all ranks agree on every outcome)."""
        return self.torchrun_rank == 0

    @property
    def answers_asked(self) -> str:
        """Where the implementation's answers before launch are asked."""
        if self.torchrun_world_size:
            return "on rank 0, whose answers every rank takes"
        return "in the pytest process"

    def world_sizes(self, selected: tuple) -> tuple:
        """The world sizes this session runs."""
        return (self.torchrun_world_size,) if self.torchrun_world_size else selected

    def startup_error(self, placement_refused: Callable[[int], str | None]) -> str | None:
        """Why this session cannot start at all (torchrun launched a world its
        host cannot place), else None."""
        refused = self.torchrun_world_size and placement_refused(self.torchrun_world_size)
        return f"torchrun: {refused}; drop --gpu-sharing off to share GPUs over gloo" if refused else None

    def world_size_skip(self, world_size: int, selected: tuple) -> str | None:
        """Why a case of ``world_size`` does not run in this mode, else None."""
        if self.torchrun_world_size:
            if world_size != self.torchrun_world_size:
                return f"torchrun launched W={self.torchrun_world_size}; this case needs W={world_size}"
            return None
        if world_size not in selected:
            sizes = ",".join(map(str, selected))
            return f"W={world_size} is not selected (--world-sizes {sizes}); add it to --world-sizes to run it"
        return None

    def spawned_only_skip(self) -> str | None:
        """Why a test that needs the spawned pool does not run, else None."""
        return "needs the spawned pool of plain pytest; skipped under torchrun" if self.torchrun_world_size else None

    def unsupported_world_sizes(self, supported: set, selected: tuple, asked: str | None) -> str | None:
        """Why no collected test supporting the world sizes this session runs
        is a usage error, else None. ``asked``: the --world-sizes option as
        given (None: the defaults, which suit any test selection)."""
        names = ", ".join(map(str, sorted(supported)))
        if self.torchrun_world_size:
            if self.torchrun_world_size in supported:
                return None
            return (
                f"torchrun launched W={self.torchrun_world_size}, which no collected test supports; "
                f"supported world sizes: {names} (torchrun --nproc-per-node N)"
            )
        unsupported = sorted(set(selected) - supported) if asked else []
        if not unsupported:
            return None
        return (
            f"--world-sizes {asked}: no collected test supports W={', '.join(map(str, unsupported))}; "
            f"supported world sizes: {names}"
        )

    def launcher(
        self,
        placement: Callable[[int], Placement],
        *,
        impl_spec: str,
        case_timeout: float,
        startup_timeout: float,
    ) -> Launcher:
        """The launcher of this mode's ranks: torchrun's in-process ranks, or
        the spawned pools of plain pytest."""
        if self.torchrun_world_size:
            from dcpcheck.ranks.torchrun import InProcessRanks

            return InProcessRanks(
                placement(self.torchrun_world_size),
                impl_spec=impl_spec,
                case_timeout=case_timeout,
                startup_timeout=startup_timeout,
            )
        from dcpcheck.ranks.spawned import SpawnedRanks

        return SpawnedRanks(placement, impl_spec=impl_spec, case_timeout=case_timeout, startup_timeout=startup_timeout)

    def ranks_disagree(self, launcher: Callable[[], Launcher], settings: dict) -> str | None:
        """Why this session's ranks cannot run its cases together, else None:
        under torchrun, ranks that differ in ``settings`` (what decides a
        case), or a world that did not start (its launcher is made here,
        before the first case)."""
        if not self.torchrun_world_size:
            return None  # the pools' ranks take the pytest process's settings
        try:
            return launcher().disagreement(settings)
        except LaunchError as exc:
            return f"torchrun: {exc}"

    def end_session(self, usage_error: str) -> NoReturn:
        """End a session its ranks cannot run: rank 0 with the usage error
        (exit 4, one line); under torchrun the other ranks end quietly (exit
        0), since a rank exiting first with an error gets its peers killed
        (rank 0 then before it printed) and named as the job's root cause."""
        if self.reports:
            raise pytest.UsageError(usage_error)
        pytest.exit(usage_error, returncode=pytest.ExitCode.OK)

    def guard_exit(self, exit_status: Callable[[], int]) -> None:
        """Under torchrun, no rank aborts at exit after its report (see
        :func:`dcpcheck.ranks.torchrun.leave_at_exit_if_stranded`)."""
        if self.torchrun_world_size:
            from dcpcheck.ranks.torchrun import leave_at_exit_if_stranded

            leave_at_exit_if_stranded(exit_status)
