"""The session state, built once at configure from the options and the
environment (frozen from then on), and the launcher of ranks it owns until
session end."""

from __future__ import annotations

import os
import signal
import zlib
from dataclasses import dataclass, field

import pytest

from dcpcheck import triton_interpreter
from dcpcheck.plugin.impl_answers import declaration_error, raised_while_loading
from dcpcheck.plugin.options import (
    case_timeout,
    resolve_device,
    selected_world_sizes,
    startup_timeout,
    visible_gpus,
)
from dcpcheck.plugin.run_mode import RunMode
from dcpcheck.ranks.launcher import Launcher
from dcpcheck.ranks.placement import Placement
from dcpcheck.ranks.reaper import die_with_parent
from dcpcheck.stages import STAGE_ENV, StageValueError, reached_stage


class LauncherSlot:
    """Holds the session's launcher from its first use to session end."""

    def __init__(self):
        self.launcher: Launcher | None = None


@dataclass(frozen=True)
class DcpSession:
    impl_spec: str
    impl: object
    device_type: str
    selected_world_sizes: tuple
    timeout: float
    startup_timeout: float
    base_seed: int
    reached: int | None
    gpus: int = 0  # visible GPUs (0 on CPU)
    gpu_sharing: bool = True
    mode: RunMode = RunMode()
    _slot: LauncherSlot = field(default_factory=LauncherSlot, repr=False, compare=False)

    def placement(self, world_size: int) -> Placement:
        return Placement(self.device_type, world_size, self.gpus)

    def placement_refused(self, world_size: int) -> str | None:
        """Why ``world_size`` cannot run on this host as configured, else None."""
        placement = self.placement(world_size)
        if placement.shares_gpus and not self.gpu_sharing:
            return (
                f"W={world_size} needs {world_size} GPUs (one per rank) with --gpu-sharing off; "
                f"this host has {self.gpus}"
            )
        return None

    def describe_devices(self) -> str:
        """The device and backend of every world size this session runs, for the headers."""
        sizes = self.mode.world_sizes(self.selected_world_sizes)
        placements: dict[str, list[int]] = {}
        for world_size in sizes:
            if self.placement_refused(world_size) is None:
                placements.setdefault(self.placement(world_size).describe(), []).append(world_size)
        if len(placements) == 1:
            return next(iter(placements))
        return "; ".join(f"{kind} at W={','.join(map(str, sizes))}" for kind, sizes in placements.items())

    def launcher(self) -> Launcher:
        """The session's launcher of ranks (its mode's), made on first use."""
        if self._slot.launcher is None:
            self._slot.launcher = self.mode.launcher(
                self.placement,
                impl_spec=self.impl_spec,
                case_timeout=self.timeout,
                startup_timeout=self.startup_timeout,
            )
        return self._slot.launcher

    def stop_launcher(self) -> None:
        if self._slot.launcher is not None:
            self._slot.launcher.stop()
            self._slot.launcher = None


SESSION = pytest.StashKey[DcpSession]()


def dcp_session(config) -> DcpSession:
    return config.stash[SESSION]


def seed_for_test(session: DcpSession, nodeid: str) -> int:
    """Stable per test (a rerun of one test reproduces it), varied by --dcp-seed."""
    return (session.base_seed * 1_000_003 + zlib.crc32(nodeid.encode())) % (2**31)


def pytest_configure(config):
    try:
        reached = reached_stage()
    except StageValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    # Every option is checked before the implementation is loaded: a usage error costs no import.
    timeout, start_timeout = case_timeout(config), startup_timeout(config)
    try:
        triton_interpreter.as_shipped_requested()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None

    device_type = resolve_device(config.getoption("device"))
    if device_type == "cpu":
        # Must precede the first triton import, here and in every rank.
        os.environ["TRITON_INTERPRET"] = "1"

    from dcpcheck.impls.registry import ImplSpecError, load_implementation_within

    spec = config.getoption("dcp_impl")
    try:
        impl, unreadable = load_implementation_within(spec, start_timeout, lambda impl: declaration_error(spec, impl))
    except ImplSpecError as exc:
        raise pytest.UsageError(str(exc)) from None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - an attribute of the implementation raising as the registry reads it
        raise pytest.UsageError(raised_while_loading(spec, exc)) from None
    if unreadable:
        raise pytest.UsageError(unreadable)
    triton_interpreter.install()  # after the load, which imports triton; ranks install theirs as they load it

    session = DcpSession(
        spec,
        impl,
        device_type,
        selected_world_sizes(config, device_type),
        timeout,
        start_timeout,
        config.getoption("dcp_seed"),
        reached,
        gpus=visible_gpus(device_type),
        gpu_sharing=config.getoption("gpu_sharing") == "on",
        mode=RunMode.detect(),
    )
    config.stash[SESSION] = session

    if hasattr(config, "workerinput"):
        # An xdist worker whose controller died (a CI timeout's SIGTERM) would
        # wait 5 s or more for execnet to give up: the kernel ends it at once,
        # and its pools with it.
        die_with_parent(signal.SIGTERM, os.getppid())

    refused = session.mode.startup_error(session.placement_refused)
    if refused:
        raise pytest.UsageError(refused)
    if not session.mode.reports:
        config.option.xmlpath = None
        config.pluginmanager.set_blocked("terminalreporter")
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


def settings_deciding_cases(config, items) -> dict:
    """What decides which cases run and how (plain data): every rank of
    torchrun's world must share it."""
    return {
        STAGE_ENV: os.environ.get(STAGE_ENV),
        "--dcp-impl": config.getoption("dcp_impl"),
        "--world-sizes": config.getoption("world_sizes"),
        "--dcp-seed": config.getoption("dcp_seed"),
        "collected tests": [item.nodeid for item in items],
    }


def pytest_sessionstart(session):
    state = session.config.stash.get(SESSION, None)
    if state is not None:
        state.mode.guard_exit(lambda: session.exitstatus)


def pytest_collection_finish(session):
    """Before the first case (after -k and --deselect: the tests that run)."""
    state = session.config.stash.get(SESSION, None)
    if state is None:
        return
    error = state.mode.ranks_disagree(state.launcher, settings_deciding_cases(session.config, session.items))
    if error:
        state.mode.end_session(error)


def pytest_sessionfinish(session, exitstatus):
    state = session.config.stash.get(SESSION, None)
    if state is not None:
        state.stop_launcher()
