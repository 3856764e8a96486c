"""Case parameters the tests spell as names (ids and failure messages stay
short), the values they stand for, and a rank's heads."""

from __future__ import annotations

import math

import torch

LSE_BASES = {"2": 2.0, "e": math.e}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def own_heads(ctx, num_heads: int) -> slice:
    """This rank's heads in TP order: ``[r*H_loc, (r+1)*H_loc)``."""
    heads_local = num_heads // ctx.world_size
    return slice(ctx.rank * heads_local, (ctx.rank + 1) * heads_local)
