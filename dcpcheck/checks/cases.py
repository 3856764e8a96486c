"""What rank functions share about a case: a rank's heads, and a layer's
output checked for its shape, dtype and device."""

from __future__ import annotations

import torch

from dcpcheck.compare import Expected, assert_outputs


def own_heads(ctx, num_heads: int) -> slice:
    """This rank's heads in TP order: ``[r*H_loc, (r+1)*H_loc)``."""
    heads_local = num_heads // ctx.world_size
    return slice(ctx.rank * heads_local, (ctx.rank + 1) * heads_local)


def checked_layer_output(out, q: torch.Tensor, device) -> torch.Tensor:
    """A layer forward's output, checked to be ``q``'s shape and dtype on
    ``device`` (``q``: this rank's heads of the layer's query)."""
    expected = (Expected("out", tuple(q.shape), q.dtype),)
    return assert_outputs("the layer's forward", out, expected, device=device)
