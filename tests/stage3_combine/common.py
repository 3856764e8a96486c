"""What the stage-3 tests share: failure context, what the implementation says
it cannot run."""

from __future__ import annotations

from dcpcheck.checks.cases import case_terms
from dcpcheck.stages import STAGE_COMBINE


def failure_context(ctx, **case) -> dict:
    """What every stage-3 failure message names (stage, W, rank, then the case)."""
    return {"stage": STAGE_COMBINE, "W": ctx.world_size, "rank": ctx.rank, **case}


def combine_unavailable_reason(ctx, **case) -> str | None:
    """The implementation's answer to ``unavailable_reason`` for a combine of
    ``case`` on this rank's device and world size, in the terms the harness
    hands it before launch; None when it can run it or has no such method."""
    ask = getattr(ctx.impl, "unavailable_reason", None)
    if ask is None:
        return None
    return ask(case_terms(device=ctx.device.type, world_size=ctx.world_size, capabilities=("combine",), case=case))
