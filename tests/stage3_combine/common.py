"""What the stage-3 tests share: what the implementation says it cannot run
with another backend, a combine of this rank's partials with its outputs' types
checked, and inputs as strided views the way engines hand them over."""

from __future__ import annotations

import dataclasses

import torch

from dcpcheck.compare import Expected, assert_outputs, format_context


def combine_unavailable_reason(ctx, backend: str) -> str | None:
    """The implementation's answer to ``unavailable_reason`` for this rank's
    case with the combine ``backend`` instead (the terms the harness handed it
    before launch, but for the backend); None when it can run it or has no
    such method."""
    ask = getattr(ctx.impl, "unavailable_reason", None)
    if ask is None:
        return None
    return ask(dataclasses.replace(ctx.case.terms, backend=backend))


def combine_with_lse(ctx, out, lse, *, backend, lse_base, context: dict, capability="combine(return_lse=True)"):
    """This rank's partials (``out`` [T, H, D], ``lse`` [T, H] on its device)
    combined with ``return_lse=True`` -> (out [T, H_loc, D] in ``out``'s dtype,
    lse [T, H_loc] fp32), each checked for shape, dtype and device;
    ``capability`` is what a failure calls the call."""
    num_tokens, num_heads, head_dim = out.shape
    heads_local = num_heads // ctx.world_size
    return assert_outputs(
        capability,
        ctx.impl.combine(out, lse, ctx.group, backend=backend, lse_base=lse_base, return_lse=True),
        [
            Expected("out", (num_tokens, heads_local, head_dim), out.dtype),
            Expected("lse", (num_tokens, heads_local), torch.float32),
        ],
        device=ctx.device,
        context=format_context(context),
    )


def transposed_view(lse: torch.Tensor, device) -> torch.Tensor:
    """[T, H] as FlashMLA hands its LSE over: the transposed view of a [H, T]
    buffer on ``device`` (strides (1, T)). Built there: a ``.to()`` of a view
    copies it into a contiguous tensor."""
    return lse.to(device).t().contiguous().t()


def padded_view(x: torch.Tensor, device, *, extra: int = 8) -> torch.Tensor:
    """``x`` [..., D] on ``device`` as the leading D columns of a wider buffer
    whose other columns hold NaN: the row stride is above D, and reading past
    D poisons the result."""
    wide = torch.cat([x.to(device), torch.full((*x.shape[:-1], extra), float("nan"), dtype=x.dtype, device=device)], -1)
    return wide[..., : x.shape[-1]]
