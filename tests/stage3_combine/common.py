"""What the stage-3 tests share: what the implementation says it cannot run
with another backend, a combine of this rank's partials with its outputs' types
checked, inputs as strided views the way engines hand them over, and the
combine check of given partials (rank functions: the ranks import them from
here)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dcpcheck.case_terms import DTYPES, LSE_BASES
from dcpcheck.checks.cases import own_heads
from dcpcheck.compare import (
    Expected,
    MismatchError,
    assert_close,
    assert_lse_close,
    assert_outputs,
    format_context,
)
from dcpcheck.oracle.attention import merge_partials
from dcpcheck.scenarios.partials import synthetic_partials


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


def check_combine(ctx, *, backend, lse_base, dtype_name, num_heads, head_dim, views=False):
    """:func:`check_combine_of` on :func:`synthetic_partials`."""
    outs, lses = synthetic_partials(ctx.generator(), ctx.world_size, num_heads, DTYPES[dtype_name], head_dim)
    return check_combine_of(ctx, outs, lses, backend=backend, lse_base=lse_base, dtype_name=dtype_name, views=views)


def check_combine_of(ctx, outs, lses, *, backend, lse_base, dtype_name, views=False):
    """One rank, given every rank's partials (outs [W, T, H, D], lses [W, T, H]):
    its backend's result vs the oracle merge (out and LSE of its heads),
    return_lse=False vs True, and the other backend, unless the
    implementation says that one cannot run here. ``views``: the partial
    output is the leading columns of a wider buffer and the LSE the
    transposed view of a [H, T] buffer, as engines hand them over."""
    base = LSE_BASES[lse_base]
    _, num_tokens, num_heads, head_dim = outs.shape
    context = ctx.failure_context(
        backend=backend, lse_base=lse_base, dtype=dtype_name, H=num_heads, D=head_dim, views=views
    )
    if views:
        out, lse = padded_view(outs[ctx.rank], ctx.device), transposed_view(lses[ctx.rank], ctx.device)
    else:
        out, lse = outs[ctx.rank].to(ctx.device), lses[ctx.rank].to(ctx.device)

    if num_heads % ctx.world_size:
        with pytest.raises(ValueError, match=rf"H={num_heads}.*W={ctx.world_size}.*accepted"):
            ctx.impl.combine(out, lse, ctx.group, backend=backend, lse_base=base)
        return {}

    heads = own_heads(ctx, num_heads)
    if ctx.world_size == 1:
        merged, merged_lse = combine_with_lse(ctx, out, lse, backend=backend, lse_base=base, context=context)
        if merged is not out or merged_lse is not lse:
            raise MismatchError(f"W=1 combine must return its inputs unchanged ({context})")
        if ctx.impl.combine(out, lse, ctx.group, backend=backend, lse_base=base) is not out:
            raise MismatchError(f"W=1 combine without return_lse must return out itself ({context})")
        return {}

    report = {"context": context, "offsets": (0, heads.start, 0)}  # global head ids in messages
    want_out, want_lse = merge_partials(outs, lses, lse_base=base)
    merged, merged_lse = combine_with_lse(ctx, out, lse, backend=backend, lse_base=base, context=context)
    stats = assert_close(merged, want_out[:, heads], what="combined output vs oracle merge", **report)
    assert_lse_close(merged_lse, want_lse[:, heads], what="combined LSE vs oracle merge", **report)

    only_out = assert_outputs(
        "combine(return_lse=False)",
        ctx.impl.combine(out, lse, ctx.group, backend=backend, lse_base=base),
        [Expected("out", (num_tokens, heads.stop - heads.start, head_dim), outs.dtype)],
        device=ctx.device,
        context=format_context(context),
    )
    assert_close(only_out, merged, what="combine(return_lse=False) vs return_lse=True", **report)

    other = "a2a" if backend == "ag_rs" else "ag_rs"
    # The same answer on every rank (it depends on the case only), so no rank
    # skips a collective its peers enter.
    other_unavailable = combine_unavailable_reason(ctx, other)
    if other_unavailable:
        return {**stats.as_dict(), "cross_check": f"{other} vs {backend} skipped: {other_unavailable}"}
    other_out, other_lse = combine_with_lse(
        ctx,
        out,
        lse,
        backend=other,
        lse_base=base,
        context=context,
        capability=f"combine(backend={other!r}, return_lse=True)",
    )
    assert_close(other_out, merged, what=f"{other} vs {backend} output", **report)
    assert_lse_close(other_lse, merged_lse, what=f"{other} vs {backend} LSE", **report)
    return {**stats.as_dict(), "cross_check": f"{other} vs {backend}"}
