"""The session state, built at configure from the options and the
environment, and the launcher of ranks it owns until session end."""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

import pytest

from dcpcheck.plugin.options import case_timeout, resolve_device, selected_world_sizes, startup_timeout
from dcpcheck.ranks.launcher import Launcher
from dcpcheck.stages import StageValueError, reached_stage


@dataclass
class DcpSession:
    impl_spec: str
    impl: object
    device_type: str
    selected_world_sizes: tuple
    timeout: float
    startup_timeout: float
    base_seed: int
    reached: int | None
    torchrun_world_size: int | None = None
    _launcher: Launcher | None = None

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"

    @property
    def mode(self) -> str:
        return "torchrun" if self.torchrun_world_size else "spawned pool"

    def launcher(self) -> Launcher:
        """The session's launcher of ranks, made on first use: torchrun's
        in-process ranks, or the spawned pools of plain pytest."""
        if self._launcher is None:
            if self.torchrun_world_size:
                from dcpcheck.ranks.torchrun import InProcessRanks

                self._launcher = InProcessRanks(self.device_type, self.timeout)
            else:
                from dcpcheck.ranks.spawned import SpawnedRanks

                self._launcher = SpawnedRanks(
                    self.device_type, case_timeout=self.timeout, startup_timeout=self.startup_timeout
                )
        return self._launcher

    def stop_launcher(self) -> None:
        if self._launcher is not None:
            self._launcher.stop()
            self._launcher = None


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

    device_type = resolve_device(config.getoption("device"))
    if device_type == "cpu":
        # Must precede the first triton import, here and in every rank.
        os.environ["TRITON_INTERPRET"] = "1"

    from dcpcheck.impls.registry import ImplSpecError, load_implementation

    spec = config.getoption("dcp_impl")
    try:
        impl = load_implementation(spec)
    except ImplSpecError as exc:
        raise pytest.UsageError(str(exc)) from None

    session = DcpSession(
        spec,
        impl,
        device_type,
        selected_world_sizes(config, device_type),
        timeout,
        start_timeout,
        config.getoption("dcp_seed"),
        reached,
    )
    config.stash[SESSION] = session

    from dcpcheck.ranks.torchrun import launched_by_torchrun, launcher_rank, launcher_world_size

    if launched_by_torchrun():
        session.torchrun_world_size = launcher_world_size()
        if launcher_rank() != 0:
            # Only rank 0 reports (terminal and --junitxml); all ranks still
            # agree on every outcome.
            config.option.xmlpath = None
            config.pluginmanager.set_blocked("terminalreporter")
            reporter = config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                config.pluginmanager.unregister(reporter)


def pytest_sessionfinish(session, exitstatus):
    state = session.config.stash.get(SESSION, None)
    if state is not None:
        state.stop_launcher()
