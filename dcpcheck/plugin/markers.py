"""The suite's markers, the world-size parametrization of the ``dcp``
fixture, and every skip: decided at collection, the same on every rank."""

from __future__ import annotations

import pytest

from dcpcheck.impls.protocol import SCENARIO_PROPERTIES
from dcpcheck.plugin import junit_properties
from dcpcheck.plugin.session import DcpSession, dcp_session
from dcpcheck.ranks.gpu_ledger import CUDA_CONTEXT_GIB, GPU_MEMORY_USABLE
from dcpcheck.stages import skip_reason as stage_skip_reason

DEFAULT_WORLD_SIZES = (1, 2, 4, 8)  # what a multi-rank test supports unless it says otherwise
MARKERS = (
    "stage(n): the test validates port stage n; skipped when DSV41_DCP_STAGE < n",
    "needs(*capabilities): implementation capabilities the test calls; skipped when one is missing",
    "world_sizes(*sizes): the DCP world sizes the test supports (default 1, 2, 4, 8)",
    "gpu: needs CUDA devices",
    "nccl: needs NCCL between the ranks (e.g. CUDA-graph capture of collectives); skipped where ranks share a GPU",
    "gpu_memory(gib_per_rank): GPU memory one rank needs; skipped where the ranks sharing a GPU would not fit",
    "spawned_only: needs the spawned pool (skipped under torchrun)",
    "scenario(*properties): named properties of the case's scenario (dcpcheck.impls.protocol."
    "SCENARIO_PROPERTIES), handed to the implementation's known_defect and unavailable_reason",
)


def pytest_configure(config):
    for line in MARKERS:
        config.addinivalue_line("markers", line)


def pytest_generate_tests(metafunc):
    if "dcp" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("world_sizes")
    sizes = tuple(marker.args) if marker else DEFAULT_WORLD_SIZES
    metafunc.parametrize("dcp", sizes, indirect=True, ids=[f"W{w}" for w in sizes])


def needed_capabilities(item) -> list[str]:
    return [cap for marker in item.iter_markers("needs") for cap in marker.args]


def scenario_properties(item) -> set[str]:
    return {name for marker in item.iter_markers("scenario") for name in marker.args}


def _world_size_skip(session: DcpSession, world_size: int) -> str | None:
    return session.mode.world_size_skip(world_size, session.selected_world_sizes) or session.placement_refused(
        world_size
    )


def _skip_reason(item, session: DcpSession) -> str | None:
    from dcpcheck.impls.registry import missing_capabilities

    stage_marker = item.get_closest_marker("stage")
    if stage_marker and session.reached is not None and stage_marker.args[0] > session.reached:
        return stage_skip_reason(stage_marker.args[0], session.reached)
    if item.get_closest_marker("spawned_only") and (reason := session.mode.spawned_only_skip()):
        return reason
    if item.get_closest_marker("gpu") and session.device_type != "cuda":
        return "needs CUDA devices (run with --device cuda on a GPU host)"
    missing = missing_capabilities(session.impl, needed_capabilities(item))
    if missing:
        return f"implementation {session.impl_spec!r} lacks capability {', '.join(missing)}"
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "dcp" in callspec.params:
        world_size = callspec.params["dcp"]
        return _world_size_skip(session, world_size) or _placement_skip(item, session, world_size)
    return None


def _placement_skip(item, session: DcpSession, world_size: int) -> str | None:
    if session.device_type != "cuda":
        return None
    placement = session.placement(world_size)
    if item.get_closest_marker("nccl") and placement.backend != "nccl":
        return (
            f"needs NCCL between the ranks; at W={world_size} they run {placement.describe()} "
            "(NCCL refuses two ranks on one GPU, and CUDA graphs cannot capture gloo collectives)"
        )
    memory = item.get_closest_marker("gpu_memory")
    if memory:
        import torch

        smallest = min(torch.cuda.get_device_properties(i).total_memory for i in range(placement.gpus_used))
        return memory_skip(memory.args[0], placement, smallest / 2**30)
    return None


def _gib_per_gpu(gib_per_rank: float, placement) -> float:
    """GiB the busiest GPU holds for ranks needing ``gib_per_rank`` each, their CUDA contexts included."""
    return (gib_per_rank + CUDA_CONTEXT_GIB) * placement.ranks_per_gpu


def gpu_gib_needed(item, placement) -> float:
    """GiB a GPU must hold for the ranks of ``item`` placed there: its
    ``gpu_memory`` marker's need and their CUDA contexts (0 unmarked: an unmarked case waits for no one, and
    no one for it; on one H100, holding 0.8 GiB a rank for every unmarked case queued the small cases behind
    each large one and left wave 1's cores 76 % idle)."""
    memory = item.get_closest_marker("gpu_memory")
    return _gib_per_gpu(memory.args[0], placement) if memory else 0.0


def memory_skip(gib_per_rank: float, placement, gpu_gib: float) -> str | None:
    """Why ranks needing ``gib_per_rank`` each do not fit on GPUs of ``gpu_gib``, else None."""
    need_gib = _gib_per_gpu(gib_per_rank, placement)
    if need_gib <= GPU_MEMORY_USABLE * gpu_gib:
        return None
    return (
        f"needs {gib_per_rank:g} GiB per rank (+{CUDA_CONTEXT_GIB:g} GiB CUDA context); at W={placement.world_size} "
        f"({placement.describe()}) a GPU would hold {need_gib:g} GiB, above {GPU_MEMORY_USABLE:.0%} of its "
        f"{gpu_gib:.0f} GiB"
    )


def _check_world_sizes_are_supported(config, session: DcpSession, items) -> None:
    """A world size that no collected test supports would skip everything and
    pass: a green run that checked nothing. Only asked sizes are checked (the
    defaults suit any test selection)."""
    callspecs = [getattr(item, "callspec", None) for item in items]
    supported = {spec.params["dcp"] for spec in callspecs if spec is not None and "dcp" in spec.params}
    if not supported:
        return  # no multi-rank test collected: world sizes play no part
    error = session.mode.unsupported_world_sizes(
        supported, session.selected_world_sizes, config.getoption("world_sizes")
    )
    if error:
        raise pytest.UsageError(error)


@pytest.hookimpl(tryfirst=True)  # before -k / --deselect: every collected test counts as support
def pytest_collection_modifyitems(config, items):
    session = dcp_session(config)
    _check_world_sizes_are_supported(config, session, items)
    for item in items:
        unknown = sorted(scenario_properties(item) - set(SCENARIO_PROPERTIES))
        if unknown:
            raise pytest.UsageError(
                f"{item.nodeid}: unknown scenario properties {unknown}; known: {sorted(SCENARIO_PROPERTIES)}"
            )
        stage_marker = item.get_closest_marker("stage")
        if stage_marker:
            item.user_properties.append((junit_properties.STAGE, stage_marker.args[0]))
        reason = _skip_reason(item, session)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
