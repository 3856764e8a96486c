"""The implementation's stage gate (DESIGN.md "The gate"): part of reaching stage 3.

With W > 1 and ``DSV41_DCP_STAGE`` below 3, building the DCP attention path
must raise NotImplementedError naming the variable and the way out, once the
KV layout is known (an invalid layout is reported as such first), before any
forward and before any collective: no collective through the group, and none
straight through torch.distributed. From stage 3 on, or unset, it builds; at
W = 1 it builds and runs at any stage. Every case sets the variable itself,
inside the ranks, so the session's own value does not matter.
"""

from __future__ import annotations

import pytest

from dcpcheck.checks.serving_trace import check_serving_trace
from dcpcheck.compare import MismatchError
from dcpcheck.scenarios.layers import LayerLayout
from dcpcheck.spies import environment, spy_on_collectives
from dcpcheck.stages import STAGE_COMBINE, STAGE_ENV
from tests.e2e.common import DSV41_TOPOLOGY

pytestmark = [pytest.mark.stage(STAGE_COMBINE), pytest.mark.needs("build_attention")]

STAGES_BELOW_COMBINE = ("0", "1", "2")
STAGES_FROM_COMBINE = ("3", "9", None)  # None: unset, every stage
# DSV4.1's layer kinds (rho, bs, S): a 2-token interleave on 16-token pages.
VALID_LAYOUTS = {"ratio 2": (2, 8, 1), "ratio 1": (1, 16, 2), "SWA only": (0, 1, 1)}
# A way out is either reaching the stage or leaving DCP; real ports word it
# their own way ("unset it", "--decode-context-parallel-size 1"): any one will do.
WAY_OUT = (
    f"{STAGE_ENV}>={STAGE_COMBINE}",
    f">= {STAGE_COMBINE}",
    "unset",
    "world size 1",
    "decode-context-parallel-size 1",
    "DCP1",
)


def layout_of(name: str, world_size: int) -> LayerLayout:
    rho, bs, interleave = VALID_LAYOUTS[name]
    return LayerLayout(rho=rho, bs=bs, interleave=interleave, world_size=world_size)


def build_counting_collectives(ctx, layout, stage: str | None):
    """build_attention under ``DSV41_DCP_STAGE=stage`` -> (layer or the exception
    it raised, collectives it made through the group and directly)."""
    calls_before = ctx.group.collective_calls
    with environment(STAGE_ENV, stage), spy_on_collectives() as direct:
        try:
            outcome = ctx.impl.build_attention(layout, ctx.group)
        except Exception as exc:  # noqa: BLE001 - the caller checks which exception
            outcome = exc
    return outcome, ctx.group.collective_calls - calls_before, [name for name, _ in direct.calls]


def check_gate_refuses(ctx):
    for name in VALID_LAYOUTS:
        for stage in STAGES_BELOW_COMBINE:
            where = f"W={ctx.world_size} rank {ctx.rank}, {STAGE_ENV}={stage}, {name} layout"
            outcome, via_group, direct = build_counting_collectives(ctx, layout_of(name, ctx.world_size), stage)
            if not isinstance(outcome, NotImplementedError):
                raise MismatchError(
                    f"{where}: build_attention must raise NotImplementedError before any forward; "
                    f"it {'raised ' + repr(outcome) if isinstance(outcome, Exception) else 'built a layer'}"
                )
            message = str(outcome)
            if STAGE_ENV not in message or not any(way in message for way in WAY_OUT):
                raise MismatchError(
                    f"{where}: the message must name {STAGE_ENV} and a way out (one of {WAY_OUT}): {message!r}"
                )
            if via_group or direct:
                raise MismatchError(
                    f"{where}: the gate must refuse before any collective; it made {via_group} "
                    f"through the group and {direct} directly through torch.distributed"
                )


def check_layout_checked_first(ctx):
    """A layout the port cannot run is reported as a layout error even below
    stage 3 (the gate runs once the layout is known)."""
    invalid = {
        "bs % S != 0": LayerLayout(rho=2, bs=6, interleave=4, world_size=ctx.world_size),
        "layout for another W": LayerLayout(rho=2, bs=8, interleave=1, world_size=ctx.world_size + 1),
    }
    for what, layout in invalid.items():
        outcome, via_group, direct = build_counting_collectives(ctx, layout, "2")
        if not isinstance(outcome, ValueError) or via_group or direct:
            raise MismatchError(
                f"W={ctx.world_size} rank {ctx.rank}, {what}: expected a ValueError about the layout "
                f"and no collective, got {outcome!r} and {via_group + len(direct)} collectives"
            )


def check_gate_admits(ctx):
    for name in VALID_LAYOUTS:
        for stage in STAGES_FROM_COMBINE:
            outcome, _, _ = build_counting_collectives(ctx, layout_of(name, ctx.world_size), stage)
            if isinstance(outcome, Exception):
                raise MismatchError(
                    f"W={ctx.world_size} rank {ctx.rank}, {STAGE_ENV}={stage}, {name} layout: "
                    f"build_attention must build from stage {STAGE_COMBINE} on; it raised {outcome!r}"
                )


@pytest.mark.world_sizes(2, 4, 8)
def test_gate_refuses_dcp_below_stage_3_before_any_collective(dcp):
    dcp.run(check_gate_refuses)


@pytest.mark.world_sizes(2, 4, 8)
def test_gate_reports_an_invalid_layout_first(dcp):
    dcp.run(check_layout_checked_first)


@pytest.mark.world_sizes(2, 4, 8)
def test_gate_admits_stage_3_and_later(dcp):
    dcp.run(check_gate_admits)


def check_single_rank_at_any_stage(ctx):
    """W = 1 builds at every stage, and at stage 0 the whole serving trace
    still matches the oracle."""
    for name in VALID_LAYOUTS:
        for stage in STAGES_BELOW_COMBINE:
            outcome, _, _ = build_counting_collectives(ctx, layout_of(name, 1), stage)
            if isinstance(outcome, Exception):
                raise MismatchError(
                    f"W=1, {STAGE_ENV}={stage}, {name} layout: W = 1 must build at any stage; "
                    f"build_attention raised {outcome!r}"
                )
    with environment(STAGE_ENV, "0"):
        return check_serving_trace(
            ctx, backend="ag_rs", prefill_gather=False, topology=DSV41_TOPOLOGY, interleave_tokens=2
        )


@pytest.mark.world_sizes(1)
def test_single_rank_runs_at_any_stage(dcp):
    dcp.run(check_single_rank_at_any_stage)


# The variable as people set it: `DSV41_DCP_STAGE=` in a launch script is
# "unset"; ` 3` from a YAML value is stage 3; `3a` is not a stage.
def check_stage_value_builds(ctx, *, value):
    """A value that means "unset" or a stage >= 3 builds the DCP path."""
    for name in VALID_LAYOUTS:
        outcome, _, _ = build_counting_collectives(ctx, layout_of(name, ctx.world_size), value)
        if isinstance(outcome, Exception):
            raise MismatchError(
                f"W={ctx.world_size} rank {ctx.rank}, {STAGE_ENV}={value!r}, {name} layout: "
                f"build_attention must build (the value means {'unset' if not value.strip() else 'stage 3'}); "
                f"it raised {outcome!r}"
            )


def check_stage_value_refused(ctx, *, value):
    """A value that is not a stage is refused, naming the variable, before any collective."""
    for name in VALID_LAYOUTS:
        where = f"W={ctx.world_size} rank {ctx.rank}, {STAGE_ENV}={value!r}, {name} layout"
        outcome, via_group, direct = build_counting_collectives(ctx, layout_of(name, ctx.world_size), value)
        if not isinstance(outcome, Exception):
            raise MismatchError(f"{where}: not a stage, yet build_attention built a layer")
        if STAGE_ENV not in str(outcome) or via_group or direct:
            raise MismatchError(
                f"{where}: the error must name {STAGE_ENV} (what was wrong, what is accepted) and come "
                f"before any collective; got {outcome!r} after {via_group + len(direct)} collectives"
            )


@pytest.mark.world_sizes(2, 4)
@pytest.mark.scenario("stage_value_empty")
def test_gate_reads_an_empty_stage_as_unset(dcp):
    dcp.run(check_stage_value_builds, value="")


@pytest.mark.world_sizes(2, 4)
def test_gate_reads_a_padded_stage(dcp):
    dcp.run(check_stage_value_builds, value=" 3")


@pytest.mark.world_sizes(2, 4)
@pytest.mark.scenario("stage_value_not_integer")
def test_gate_refuses_a_stage_that_is_not_an_integer(dcp):
    dcp.run(check_stage_value_refused, value="3a")
