"""What the stage-3 tests share: parameter names, head slices, failure context,
what the implementation says it cannot run."""

from __future__ import annotations

import math

import torch

from dcpcheck.stages import STAGE_COMBINE

LSE_BASES = {"2": 2.0, "e": math.e}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def own_heads(ctx, num_heads: int) -> slice:
    """This rank's heads in TP order: ``[r*H_loc, (r+1)*H_loc)``."""
    heads_local = num_heads // ctx.world_size
    return slice(ctx.rank * heads_local, (ctx.rank + 1) * heads_local)


def failure_context(ctx, **case) -> dict:
    """What every stage-3 failure message names (stage, W, rank, then the case)."""
    return {"stage": STAGE_COMBINE, "W": ctx.world_size, "rank": ctx.rank, **case}


def unavailable_reason(ctx, **case) -> str | None:
    """The implementation's answer to ``unavailable_reason`` for ``case`` on
    this rank's device and world size, as the harness asks it before launch;
    None when it can run the case or has no such method."""
    ask = getattr(ctx.impl, "unavailable_reason", None)
    return ask(device=ctx.device.type, world_size=ctx.world_size, **case) if ask else None
