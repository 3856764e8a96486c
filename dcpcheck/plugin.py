"""The pytest plugin: options, markers, stage gating, the ``dcp`` fixture.

Every skip is decided here, at collection, from the options, the environment
and the implementation's capabilities: the same on every rank, before any
rank is launched.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field

import pytest

from dcpcheck.stages import STAGE_ENV, STAGES, StageValueError, reached_stage, skip_reason, stage_label

DEFAULT_WORLD_SIZES = (1, 2, 4, 8)  # what a multi-rank test supports unless it says otherwise
DEFAULT_SELECTED = {"cpu": "1,2,4", "cuda": "1,2,4,8"}
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_STARTUP_TIMEOUT_S = 240.0
MARKERS = (
    "stage(n): the test validates port stage n; skipped when DSV41_DCP_STAGE < n",
    "needs(*capabilities): implementation capabilities the test calls; skipped when one is missing",
    "world_sizes(*sizes): the DCP world sizes the test supports (default 1, 2, 4, 8)",
    "gpu: needs CUDA devices",
    "spawned_only: needs the spawned pool (skipped under torchrun)",
)
# Keys of a rank function's stats dict that are worst errors: the largest over
# the ranks becomes a JUnit property (dcp_<key>) for tools/gpu_ci.py.
WORST_ERROR_KEYS = ("worst_ratio", "max_abs_err")


@dataclass
class DcpSession:
    impl_spec: str
    impl: object
    device_type: str
    selected_world_sizes: tuple
    timeout: float
    base_seed: int
    reached: int | None
    launcher: object = None
    torchrun_world_size: int | None = None
    stage_of: dict = field(default_factory=dict)

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"

    @property
    def mode(self) -> str:
        return "torchrun" if self.torchrun_world_size else "spawned pool"


SESSION = pytest.StashKey[DcpSession]()


def pytest_addoption(parser):
    group = parser.getgroup("dcpcheck", "DCP staged correctness suite")
    group.addoption("--dcp-impl", default="port", help="implementation under test: port (default), vllm, pkg.module:attr or path/file.py:attr")
    group.addoption("--world-sizes", default=None, help="comma-separated DCP world sizes to run (default 1,2,4 on CPU; 1,2,4,8 on CUDA, capped by the GPU count)")
    group.addoption("--dcp-timeout", type=float, default=DEFAULT_TIMEOUT_S, help=f"seconds one multi-rank case may take before its ranks are declared stuck (default {DEFAULT_TIMEOUT_S:g})")
    group.addoption("--dcp-startup-timeout", type=float, default=DEFAULT_STARTUP_TIMEOUT_S, help=f"seconds a pool of ranks may take to start (default {DEFAULT_STARTUP_TIMEOUT_S:g})")
    group.addoption("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where ranks run: auto = cuda when a GPU is visible, else cpu")
    group.addoption("--dcp-seed", type=int, default=0, help="base seed; each test adds a stable hash of its id")


def _parse_world_sizes(raw: str) -> tuple:
    try:
        sizes = tuple(sorted({int(part) for part in raw.split(",") if part.strip()}))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise pytest.UsageError(f"--world-sizes {raw!r}: expected comma-separated positive integers, e.g. 1,2,4,8")
    return sizes


def _resolve_device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda: no CUDA device is visible (use --device cpu or auto)")
    return choice


def pytest_configure(config):
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    try:
        reached = reached_stage()
    except StageValueError as exc:
        raise pytest.UsageError(str(exc)) from None

    device_type = _resolve_device(config.getoption("device"))
    if device_type == "cpu":
        # Must precede the first triton import, here and in every rank.
        os.environ["TRITON_INTERPRET"] = "1"

    from dcpcheck.impls.registry import ImplSpecError, load_implementation

    spec = config.getoption("dcp_impl")
    try:
        impl = load_implementation(spec)
    except ImplSpecError as exc:
        raise pytest.UsageError(str(exc)) from None

    selected = _parse_world_sizes(config.getoption("world_sizes") or DEFAULT_SELECTED[device_type])
    timeout = config.getoption("dcp_timeout")
    if timeout <= 0:
        raise pytest.UsageError(f"--dcp-timeout {timeout:g}: expected a positive number of seconds")
    session = DcpSession(spec, impl, device_type, selected, timeout, config.getoption("dcp_seed"), reached)
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


def _session(config) -> DcpSession:
    return config.stash[SESSION]


def _launcher(session: DcpSession, config):
    if session.launcher is None:
        if session.torchrun_world_size:
            from dcpcheck.ranks.torchrun import InProcessRanks

            session.launcher = InProcessRanks(session.device_type, session.timeout)
        else:
            from dcpcheck.ranks.spawned import SpawnedRanks

            session.launcher = SpawnedRanks(
                session.device_type,
                case_timeout=session.timeout,
                startup_timeout=config.getoption("dcp_startup_timeout"),
            )
    return session.launcher


def pytest_generate_tests(metafunc):
    if "dcp" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("world_sizes")
    sizes = tuple(marker.args) if marker else DEFAULT_WORLD_SIZES
    metafunc.parametrize("dcp", sizes, indirect=True, ids=[f"W{w}" for w in sizes])


def _world_size_skip(session: DcpSession, world_size: int) -> str | None:
    if session.torchrun_world_size:
        if world_size != session.torchrun_world_size:
            return f"torchrun launched W={session.torchrun_world_size}; this case needs W={world_size}"
        return None
    if world_size not in session.selected_world_sizes:
        sizes = ",".join(map(str, session.selected_world_sizes))
        return f"W={world_size} is not selected (--world-sizes {sizes}); add it to --world-sizes to run it"
    if session.device_type == "cuda":
        import torch

        count = torch.cuda.device_count()
        if world_size > count:
            return f"W={world_size} needs {world_size} GPUs (one per rank); this host has {count}"
    return None


def _skip_reason(item, session: DcpSession) -> str | None:
    from dcpcheck.impls.registry import missing_capabilities

    stage_marker = item.get_closest_marker("stage")
    if stage_marker and session.reached is not None and stage_marker.args[0] > session.reached:
        return skip_reason(stage_marker.args[0], session.reached)
    if item.get_closest_marker("spawned_only") and session.torchrun_world_size:
        return "needs the spawned pool of plain pytest; skipped under torchrun"
    if item.get_closest_marker("gpu") and session.device_type != "cuda":
        return "needs CUDA devices (run with --device cuda on a GPU host)"
    needed = [cap for marker in item.iter_markers("needs") for cap in marker.args]
    missing = missing_capabilities(session.impl, needed)
    if missing:
        return f"implementation {session.impl_spec!r} lacks capability {', '.join(missing)}"
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "dcp" in callspec.params:
        return _world_size_skip(session, callspec.params["dcp"])
    return None


def pytest_collection_modifyitems(config, items):
    session = _session(config)
    for item in items:
        stage_marker = item.get_closest_marker("stage")
        if stage_marker:
            item.user_properties.append(("dcp_stage", stage_marker.args[0]))
        reason = _skip_reason(item, session)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


def seed_for_test(session: DcpSession, nodeid: str) -> int:
    """Stable per test (a rerun of one test reproduces it), varied by --dcp-seed."""
    return (session.base_seed * 1_000_003 + zlib.crc32(nodeid.encode())) % (2**31)


class DcpRunner:
    """The ``dcp`` fixture: runs a rank function on ``world_size`` ranks."""

    def __init__(self, request, session: DcpSession, world_size: int):
        self.world_size = world_size
        self.session = session
        self.impl = session.impl
        self.device_type = session.device_type
        self.nodeid = request.node.nodeid
        self.seed = seed_for_test(session, self.nodeid)
        stage_marker = request.node.get_closest_marker("stage")
        self.stage = stage_marker.args[0] if stage_marker else None
        self._config = request.config
        self._node = request.node

    def header(self) -> dict:
        return {
            "stage": stage_label(self.stage) if self.stage is not None else "harness",
            "W": self.world_size,
            "device": f"{self.device_type}/{self.session.backend}",
            "impl": self.session.impl_spec,
            "mode": self.session.mode,
            "seed": self.seed,
        }

    def run(self, fn, *, timeout: float | None = None, **case) -> list:
        """Run ``fn(ctx, **case)`` on every rank; fail unless all ranks pass.
        Returns each rank's return value, in rank order."""
        from dcpcheck.ranks.launcher import LaunchError
        from dcpcheck.ranks.report import format_case_failure

        unavailable = getattr(self.impl, "unavailable_reason", None)
        if unavailable is not None:
            reason = unavailable(device=self.device_type, world_size=self.world_size, **case)
            if reason:
                pytest.skip(reason)
        known_defect = getattr(self.impl, "known_defect", None)
        if known_defect is not None:
            defect = known_defect(
                check=fn.__name__, device=self.device_type, world_size=self.world_size, **case
            )
            if defect:
                # The check still runs: a failure is reported as xfailed with
                # this reason, a pass as XPASS (the defect may be fixed).
                self._node.add_marker(pytest.mark.xfail(reason=f"known defect of {self.session.impl_spec}: {defect}"))
        timeout = timeout or self.session.timeout
        self._node.user_properties.append(("dcp_world_size", self.world_size))
        if case.get("backend"):
            self._node.user_properties.append(("dcp_backend", case["backend"]))
        launcher = _launcher(self.session, self._config)
        try:
            result = launcher.run(
                self.world_size, fn, case, seed=self.seed, impl_spec=self.session.impl_spec, timeout=timeout
            )
        except LaunchError as exc:
            pytest.fail(f"{self.header()}\n{exc}", pytrace=False)
        if not result.ok:
            pytest.fail(format_case_failure(result, header=self.header(), case=case, timeout=timeout), pytrace=False)
        values = [result.outcomes[rank].value for rank in range(self.world_size)]
        self._record_worst_errors(values)
        return values

    def _record_worst_errors(self, values: list) -> None:
        for key in WORST_ERROR_KEYS:
            found = [v[key] for v in values if isinstance(v, dict) and isinstance(v.get(key), (int, float))]
            if found:
                self._node.user_properties.append((f"dcp_{key}", max(found)))


@pytest.fixture
def dcp(request) -> DcpRunner:
    return DcpRunner(request, _session(request.config), request.param)


@pytest.fixture
def dcp_session(request) -> DcpSession:
    return _session(request.config)


def pytest_sessionfinish(session, exitstatus):
    state = session.config.stash.get(SESSION, None)
    if state is not None and state.launcher is not None:
        state.launcher.stop()
        state.launcher = None


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """A stage x outcome table, so a run says at a glance which stages hold."""
    counts: dict = {}
    for outcome in ("passed", "failed", "skipped", "xfailed", "xpassed", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            stage = dict(getattr(report, "user_properties", ())).get("dcp_stage")
            if stage is None or (report.when != "call" and outcome == "passed"):
                continue
            row = counts.setdefault(stage, {})
            row[outcome] = row.get(outcome, 0) + 1
    if not counts:
        return
    columns = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
    terminalreporter.section("dcpcheck stages")
    session = config.stash.get(SESSION, None)
    if session is not None:
        terminalreporter.write_line(
            f"impl={session.impl_spec} device={session.device_type}/{session.backend} "
            f"mode={session.mode} {STAGE_ENV}={'unset' if session.reached is None else session.reached}"
        )
    terminalreporter.write_line(f"{'stage':<40}" + "".join(f"{c:>9}" for c in columns))
    for stage in sorted(counts):
        row = counts[stage]
        name = f"{stage} {STAGES.get(stage, '')}"
        terminalreporter.write_line(f"{name:<40}" + "".join(f"{row.get(c, 0):>9}" for c in columns))
