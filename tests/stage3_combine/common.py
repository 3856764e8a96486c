"""What the stage-3 tests share: failure context, what the implementation says
it cannot run."""

from __future__ import annotations

from dcpcheck.stages import STAGE_COMBINE


def failure_context(ctx, **case) -> dict:
    """What every stage-3 failure message names (stage, W, rank, then the case)."""
    return {"stage": STAGE_COMBINE, "W": ctx.world_size, "rank": ctx.rank, **case}


def unavailable_reason(ctx, **case) -> str | None:
    """The implementation's answer to ``unavailable_reason`` for ``case`` on
    this rank's device and world size, as the harness asks it before launch;
    None when it can run the case or has no such method."""
    ask = getattr(ctx.impl, "unavailable_reason", None)
    return ask(device=ctx.device.type, world_size=ctx.world_size, **case) if ask else None
