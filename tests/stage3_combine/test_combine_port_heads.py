"""Stage 3: the combine at a DCP2 port's own shapes, H = 8·W (8 heads per
rank, the unpadded minimum its kernels take), bf16 partials, base-2 LSEs.

Every implementation runs the combine checks of ``test_combine.py`` there
(:func:`tests.stage3_combine.common.check_combine`).
A port that fuses its sink gather, kernel call and combine into one step
(``fused_combine``: the DCP2 port's ``_run_sm120_dcp``) is also checked
through that step: its output against the oracle merge, and what it hands
its kernel on each rank — the sink gathered in TP head order on rank 0
(``_dcp_attn_sink``) and none elsewhere, the window rows on rank 0 as given
and all ``-1`` with zero lengths elsewhere (``_dcp_neutral_swa``).
"""

from __future__ import annotations

import pytest
import torch

from dcpcheck.case_terms import DTYPES, LSE_BASES
from dcpcheck.checks.cases import own_heads
from dcpcheck.compare import Expected, MismatchError, assert_close, assert_outputs, format_context
from dcpcheck.oracle.attention import merge_partials
from dcpcheck.scenarios.partials import HEAD_DIM, NUM_TOKENS, synthetic_partials
from dcpcheck.stages import STAGE_COMBINE
from tests.stage3_combine.common import check_combine

pytestmark = [
    pytest.mark.stage(STAGE_COMBINE),
    pytest.mark.scenario("lse_near_150", "port_heads"),
    pytest.mark.world_sizes(2, 4, 8),
]

PORT_LOCAL_HEADS = 8
WINDOW = 4


@pytest.mark.needs("combine")
@pytest.mark.parametrize("backend", ["ag_rs", "a2a"])
def test_combine_at_port_head_count(dcp, backend):
    dcp.run(
        check_combine,
        backend=backend,
        lse_base="2",
        dtype_name="bf16",
        num_heads=PORT_LOCAL_HEADS * dcp.world_size,
        head_dim=HEAD_DIM,
    )


def sink_mismatch(got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got.shape != want.shape:
        return f"shape {list(got.shape)}, expected {list(want.shape)}"
    differ = (got != want).nonzero().flatten()
    if differ.numel() == 0:
        return None
    head = int(differ[0])
    return f"{differ.numel()} heads differ, first head {head}: {got[head].item():g} vs {want[head].item():g}"


def check_fused_combine(ctx, *, backend, lse_base, dtype_name, head_dim):
    world, rank, dtype = ctx.world_size, ctx.rank, DTYPES[dtype_name]
    num_heads = PORT_LOCAL_HEADS * world
    context = ctx.failure_context(backend=backend, H=num_heads, D=head_dim)
    gen = ctx.generator()
    outs, lses = synthetic_partials(gen, world, num_heads, dtype, head_dim)
    sinks = torch.randn(world, PORT_LOCAL_HEADS, generator=gen) + 3.0  # [W, H_loc]: rank r's heads, TP order
    swa_indices = torch.randint(0, 64, (NUM_TOKENS, 1, WINDOW), generator=gen, dtype=torch.int32)
    swa_lens = torch.randint(1, WINDOW + 1, (NUM_TOKENS,), generator=gen, dtype=torch.int32)
    result = ctx.impl.fused_combine(
        outs[rank].to(ctx.device),
        lses[rank].to(ctx.device),
        sinks[rank].to(ctx.device),
        swa_indices.to(ctx.device),
        swa_lens.to(ctx.device),
        ctx.group,
        backend=backend,
    )
    if not (isinstance(result, tuple | list) and len(result) == 4):
        raise MismatchError(
            f"fused_combine returned {type(result).__name__}, expected a tuple (out, sink, swa_indices, swa_lens) "
            f"({format_context(context)})"
        )
    merged, kernel_sink, kernel_swa, kernel_lens = result
    assert_outputs(
        "fused_combine",
        (merged, kernel_swa, kernel_lens),
        [
            Expected("out", (NUM_TOKENS, PORT_LOCAL_HEADS, head_dim), dtype),
            Expected("swa_indices", tuple(swa_indices.shape), None),
            Expected("swa_lens", tuple(swa_lens.shape), None),
        ],
        device=ctx.device,
        context=format_context(context),
    )

    problems = []
    if rank == 0:
        want = sinks.reshape(-1)
        if kernel_sink is None:
            problems.append("rank 0 handed its kernel no sink (_run_sm120_dcp passes the gathered sink on rank 0)")
        else:
            wrong = sink_mismatch(kernel_sink.float().cpu(), want)
            if wrong:
                problems.append(
                    f"rank 0's kernel sink is not every rank's sink in TP head order (the heads of rank r at "
                    f"[r*{PORT_LOCAL_HEADS}:(r+1)*{PORT_LOCAL_HEADS}]): {wrong} (_dcp_attn_sink)"
                )
        if not (torch.equal(kernel_swa.cpu(), swa_indices) and torch.equal(kernel_lens.cpu(), swa_lens)):
            problems.append("rank 0 did not hand its kernel the window rows it was given (it attends the window)")
    else:
        if kernel_sink is not None:
            problems.append(f"rank {rank} handed its kernel a sink (_run_sm120_dcp passes it on DCP rank 0 only)")
        if bool((kernel_swa != -1).any()) or bool((kernel_lens != 0).any()):
            problems.append(
                f"rank {rank}'s kernel window rows are not all -1 with zero lengths "
                "(_dcp_neutral_swa: the window is attended on DCP rank 0 only)"
            )
    if problems:
        raise MismatchError(
            f"fused combine step, what the kernel was handed ({format_context(context)}): {'; '.join(problems)}"
        )

    heads = own_heads(ctx, num_heads)
    want_out, _ = merge_partials(outs, lses, lse_base=LSE_BASES[lse_base])
    stats = assert_close(
        merged,
        want_out[:, heads],
        what=f"fused combine step's output ({backend} combine) vs oracle merge",
        context=context,
        offsets=(0, heads.start, 0),
    )
    return stats.as_dict()


@pytest.mark.needs("fused_combine")
@pytest.mark.parametrize("backend", ["ag_rs", "a2a"])
def test_fused_combine_step(dcp, backend):
    dcp.run(check_fused_combine, backend=backend, lse_base="2", dtype_name="bf16", head_dim=HEAD_DIM)
