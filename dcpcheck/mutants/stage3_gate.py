"""Gate mutants: the port's ``DSV41_DCP_STAGE`` check in ``build_attention``.

Each buggy copy below is the port's function of the same name in
:mod:`dcpcheck.port.gate` with one change (marked ``# BUG``). The gate tests
live in ``tests/e2e`` and are stage-3 tests (the gate is part of reaching it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from dcpcheck.mutants.base import Mutant, Swap
from dcpcheck.port import gate
from dcpcheck.port.gate import (
    DcpAttentionLayer,
    prefill_gather_enabled,
    reached_stage,
    require_dcp_stage,
    validate_layout,
)
from dcpcheck.stages import STAGE_COMBINE, STAGE_ENV


class GateMutant(Mutant):
    stage = STAGE_COMBINE
    home = "tests/e2e"


def _require_dcp_stage_inclusive(world_size: int, environ: Mapping[str, str] = os.environ) -> None:
    stage = reached_stage(environ)
    if world_size > 1 and stage is not None and stage <= STAGE_COMBINE:  # BUG: refuses stage 3 itself
        raise NotImplementedError(
            f"DCP attention with world size {world_size} needs port stage {STAGE_COMBINE} (partial "
            f"attention + LSE combine), but {STAGE_ENV}={stage}: set {STAGE_ENV}>={STAGE_COMBINE} "
            f"(or unset it) or run with DCP world size 1"
        )


class GateLessOrEqual(GateMutant):
    description = "the gate compares DSV41_DCP_STAGE <= 3 instead of < 3, refusing the stage that is ready"
    bug = Swap(gate, require_dcp_stage=_require_dcp_stage_inclusive)


def _require_dcp_stage_any_world(world_size: int, environ: Mapping[str, str] = os.environ) -> None:
    stage = reached_stage(environ)
    if stage is not None and stage < STAGE_COMBINE:  # BUG: W = 1 refused too
        raise NotImplementedError(
            f"DCP attention with world size {world_size} needs port stage {STAGE_COMBINE} (partial "
            f"attention + LSE combine), but {STAGE_ENV}={stage}: set {STAGE_ENV}>={STAGE_COMBINE} "
            f"(or unset it) or run with DCP world size 1"
        )


class GateRefusesSingleRank(GateMutant):
    description = "the gate ignores the world size: W = 1 (plain attention) is refused below stage 3 too"
    bug = Swap(gate, require_dcp_stage=_require_dcp_stage_any_world)


def _require_dcp_stage_not_at_build(world_size: int, environ: Mapping[str, str] = os.environ) -> None:
    return None  # BUG: the layer below checks instead, after its first forward


class _GatedAtFirstForward(DcpAttentionLayer):
    def forward(self, plan, **inputs):
        out = super().forward(plan, **inputs)
        require_dcp_stage(self.world_size)
        return out


class GateAfterFirstForward(GateMutant):
    description = "the stage gate runs after the layer's first forward (and its collectives), not at build time"
    bug = Swap(gate, require_dcp_stage=_require_dcp_stage_not_at_build, DcpAttentionLayer=_GatedAtFirstForward)


def _build_attention_gate_first(
    impl, layout, group, *, prefill_gather: bool | None = None, **options
) -> DcpAttentionLayer:
    require_dcp_stage(group.world_size)  # BUG: moved above the layout check
    validate_layout(layout, group.world_size)
    if prefill_gather is None:
        prefill_gather = prefill_gather_enabled()
    return DcpAttentionLayer(impl, layout, group, prefill_gather=prefill_gather, **options)


class GateBeforeLayoutCheck(GateMutant):
    description = "the gate runs before the KV layout is validated: an invalid layout is reported as a stage problem"
    bug = Swap(gate, build_attention=_build_attention_gate_first)
