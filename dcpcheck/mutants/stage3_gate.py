"""Gate mutants: the port's ``DSV41_DCP_STAGE`` check in ``build_attention``
(port/gate.py). The gate tests live in ``tests/e2e`` and are stage-3 tests
(the gate is part of reaching it)."""

from __future__ import annotations

from functools import partial

from dcpcheck.mutants.patch import Mutant, Patch
from dcpcheck.stages import E2E_TEST_DIR, STAGE_COMBINE

gate_mutant = partial(Mutant, stage=STAGE_COMBINE, home=E2E_TEST_DIR)

GATE_AT_BUILD = """\
    require_dcp_stage(group.world_size)
    if prefill_gather is None:
        prefill_gather = prefill_gather_enabled()
    return DcpAttentionLayer(impl, layout, group, prefill_gather=prefill_gather, **options)
"""

GATE_AFTER_FIRST_FORWARD = """\
    if prefill_gather is None:
        prefill_gather = prefill_gather_enabled()
    layer = DcpAttentionLayer(impl, layout, group, prefill_gather=prefill_gather, **options)
    forward = layer.forward

    def forward_then_gate(plan, **inputs):
        out = forward(plan, **inputs)
        require_dcp_stage(group.world_size)
        return out

    layer.forward = forward_then_gate
    return layer
"""

MUTANTS = (
    gate_mutant(
        name="GateLessOrEqual",
        description="the gate compares DSV41_DCP_STAGE <= 3 instead of < 3, refusing the stage that is ready",
        patch=Patch("gate.py", "stage < COMBINE_STAGE:", "stage <= COMBINE_STAGE:"),
    ),
    gate_mutant(
        name="GateRefusesSingleRank",
        description="the gate ignores the world size: W = 1 (plain attention) is refused below stage 3 too",
        patch=Patch("gate.py", "if world_size > 1 and stage is not None", "if stage is not None"),
    ),
    gate_mutant(
        name="GateAfterFirstForward",
        description="the stage gate runs after the layer's first forward (and its collectives), not at build time",
        patch=Patch("gate.py", GATE_AT_BUILD, GATE_AFTER_FIRST_FORWARD),
    ),
    gate_mutant(
        name="GateBeforeLayoutCheck",
        description="the gate runs before the KV layout is validated: an invalid layout is reported as a stage problem",
        patch=Patch(
            "gate.py",
            "    validate_layout(layout, group.world_size)\n    require_dcp_stage(group.world_size)\n",
            "    require_dcp_stage(group.world_size)\n    validate_layout(layout, group.world_size)\n",
        ),
    ),
)
