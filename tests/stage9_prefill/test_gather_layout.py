"""Stage 9, exactly: the gather geometry, the id remap and the gathered buffer
against the oracle layout, id by id.

Every rank builds the same prefill step (requests shorter than a page, with
no state yet, spanning many virtual blocks), writes its own compressed cache
through its block table, gathers, and checks: pages and bases per request;
each top-k id's slot in the buffer (the message names request, token row,
id, expected and actual slot); counts; and that the buffer holds, at the
oracle's slot of every state of every request, exactly that state.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from dcpcheck.checks.prefill import prefill_step
from dcpcheck.checks.stage1 import column_slice
from dcpcheck.compare import (
    Expected,
    MismatchError,
    assert_equal_ints,
    assert_outputs,
    fail_if_problems,
    run_every_check,
)
from dcpcheck.oracle.prefill import gather_geometry, gathered_slot, remap_reference
from dcpcheck.scenarios.trace import PREFILL_REQUESTS
from dcpcheck.stages import STAGE_PREFILL

pytestmark = [
    pytest.mark.stage(STAGE_PREFILL),
    pytest.mark.needs("prefill_geometry", "prefill_remap", "prefill_gather"),
]
V40 = pytest.mark.scenario("v40_ratios")
DSV41_RATIO2 = pytest.mark.scenario("dsv41_ratio2")


def request_name(req: int) -> str:
    return f"request {req} ({PREFILL_REQUESTS[req]})"


def check_geometry(ctx, step, geometry, expected) -> None:
    batch = step.batch
    per_request = [Expected(name, (batch.num_requests,), None) for name in ("pages", "bases")]
    assert_outputs(
        "prefill_geometry", (geometry.pages, geometry.bases), per_request, device=ctx.device, context=step.case
    )
    if not isinstance(geometry.total_pages, int):
        raise MismatchError(
            f"{step.case}: prefill_geometry's total_pages is a {type(geometry.total_pages).__name__}, expected an int"
        )
    for field in ("pages", "bases"):
        assert_equal_ints(
            getattr(geometry, field).cpu(),
            getattr(expected, field),
            case=step.case,
            what=f"prefill geometry {field} vs the oracle (lengths {batch.seq_lens.tolist()})",
            name_index=request_name,
        )
    if geometry.total_pages != expected.total_pages:
        raise MismatchError(f"{step.case}: total_pages {geometry.total_pages}, expected {expected.total_pages}")


def check_remap(ctx, step, geometry, expected) -> None:
    batch, layout = step.batch, step.batch.layout
    device = ctx.device
    topk = column_slice(batch.topk, device) if step.context.get("views") else batch.topk.to(device)
    result = ctx.impl.prefill_remap(
        topk,
        batch.token_to_req.to(device),
        batch.is_valid_token.to(device),
        geometry,
        bs=layout.bs,
        world_size=ctx.world_size,
        interleave=layout.interleave,
    )
    expected_slots, expected_counts = remap_reference(
        batch.topk,
        batch.token_to_req,
        batch.is_valid_token,
        expected,
        bs=layout.bs,
        S=layout.interleave,
        W=ctx.world_size,
    )
    slots, counts = assert_outputs(
        "prefill_remap",
        result,
        [Expected("slots", tuple(batch.topk.shape), torch.int32), Expected("counts", (batch.num_tokens,), torch.int32)],
        device=device,
        context=step.case,
    )
    requests, positions, topk = batch.token_to_req.tolist(), batch.positions.tolist(), batch.topk.tolist()

    def name_entry(t: int, k: int) -> str:
        return (
            f"{request_name(requests[t])}, token row {t} ({batch.row_roles[t]}, position {positions[t]}), "
            f"id {topk[t][k]} (column {k}) slot"
        )

    # An invalid token's row is read by no one (its count is 0): its slots are free.
    valid = batch.is_valid_token[:, None]
    assert_equal_ints(
        torch.where(valid, slots.cpu().long(), expected_slots),
        expected_slots,
        case=step.case,
        what="gathered-buffer slot of each top-k id vs the oracle",
        name_index=name_entry,
    )
    assert_equal_ints(
        counts.cpu(),
        expected_counts,
        case=step.case,
        what="remap counts (valid ids)",
        name_index=lambda t: f"{request_name(requests[t])}, token row {t} ({batch.row_roles[t]})",
    )


def check_buffer(ctx, step, geometry, expected) -> None:
    """The gathered buffer holds every state of every request at its oracle slot."""
    batch, layout, inputs = step.batch, step.batch.layout, step.inputs
    table = column_slice(step.block_table, ctx.device) if step.context.get("views") else step.block_table
    buffer = ctx.impl.prefill_gather(step.comp_cache, table, geometry, ctx.group, bs=layout.bs)
    want = Expected("buffer", (expected.total_pages * layout.bs, inputs.states.shape[1]), step.comp_cache.dtype)
    buffer = assert_outputs("prefill_gather", buffer, [want], device=ctx.device, context=step.case).cpu()
    num_states = batch.num_states
    req = torch.repeat_interleave(torch.arange(batch.num_requests), num_states)
    c = torch.arange(req.numel()) - inputs.state_offsets[req]
    slot = gathered_slot(c, req, expected, bs=layout.bs, S=layout.interleave, W=ctx.world_size)
    wrong = (~(buffer[slot] == inputs.states).all(dim=1)).nonzero().flatten().tolist()
    problems = [
        f"{request_name(int(req[i]))} state {int(c[i])}: buffer slot {int(slot[i])} does not hold it" for i in wrong[:8]
    ]
    fail_if_problems(step.case, "gathered buffer contents vs every rank's states", problems, total=len(wrong))


def check_gather_layout(ctx, *, rho, S, bs, K, views=False):
    """Geometry, remap and buffer, each judged against the oracle; all three
    always run (every rank joins the gather) and their problems are reported
    together, so a wrong page count also shows the ids it misplaces.
    ``views``: the top-k and the block table are column slices of wider
    buffers, as engines hand them over."""
    step = prefill_step(ctx, rho=rho, S=S, bs=bs, top_k=K, views=views)
    expected = gather_geometry(step.batch.seq_lens, rho=rho, bs=bs, W=ctx.world_size)
    geometry = ctx.impl.prefill_geometry(step.batch.seq_lens.to(ctx.device), rho=rho, bs=bs, world_size=ctx.world_size)
    run_every_check(
        [
            (check.__name__, partial(check, ctx, step, geometry, expected))
            for check in (check_geometry, check_remap, check_buffer)
        ]
    )


# (rho, S, bs, K). DeepSeek-V4.0's ratios (4, 128; C128A: K covers every state).
V40_CASES = [
    pytest.param(4, 1, 2, 16, marks=V40),
    pytest.param(4, 2, 8, 16, marks=V40),
    pytest.param(4, 4, 8, 33, marks=V40),
    pytest.param(128, 1, 2, 8, marks=V40),
]
# DeepSeek-V4.1's ratios on vLLM's 128-token compressed page, at an
# interleave of I tokens (S = I / rho states).
DSV41_CASES = [
    pytest.param(2, 1, 64, 130, id="I2-S1-bs64-K130-rho2", marks=DSV41_RATIO2),
    pytest.param(1, 2, 128, 37, id="I2-S2-bs128-K37-rho1"),
    pytest.param(1, 64, 128, 200, id="I64-S64-bs128-K200-rho1"),
    # vllm#56715's wide interleaves: 64 tokens at ratio 2 (half a page), 128 (the page) at ratios 1 and 2.
    pytest.param(2, 32, 64, 130, id="I64-S32-bs64-K130-rho2", marks=DSV41_RATIO2),
    pytest.param(1, 128, 128, 200, id="I128-S128-bs128-K200-rho1"),
    pytest.param(2, 64, 64, 130, id="I128-S64-bs64-K130-rho2", marks=DSV41_RATIO2),
]


@pytest.mark.parametrize("rho, S, bs, K", V40_CASES + DSV41_CASES)
def test_gather_layout_matches_oracle(dcp, rho, S, bs, K):
    dcp.run(check_gather_layout, rho=rho, S=S, bs=bs, K=K)


@pytest.mark.parametrize("rho, S, bs, K", [V40_CASES[1], V40_CASES[3], DSV41_CASES[1]])
def test_gather_layout_given_views(dcp, rho, S, bs, K):
    """Top-k and block table as column slices of wider buffers (row stride above the width)."""
    dcp.run(check_gather_layout, rho=rho, S=S, bs=bs, K=K, views=True)


def check_geometry_at_page_edges(ctx, *, ratios_and_pages):
    """pages_i and base_i at and around every virtual-block edge, for W = 1,
    2, 4, 8 and each ``(rho, bs)``: state counts k*bs*W - 1, k*bs*W and
    k*bs*W + 1 (k = 0, 1, 2, so also a request with no state), each with no
    token and with rho - 1 tokens toward the next state. Fixed lengths: an
    off-by-one at an exact multiple fails at every seed, not at the seeds
    whose random lengths happen to land on one."""

    def check_edges(world_size: int, rho: int, bs: int) -> None:
        edge = bs * world_size
        states = sorted({max(k * edge + d, 0) for k in (0, 1, 2) for d in (-1, 0, 1)})
        seq_lens = torch.tensor([s * rho + extra for s in states for extra in sorted({0, rho - 1})])
        geometry = ctx.impl.prefill_geometry(seq_lens.to(ctx.device), rho=rho, bs=bs, world_size=world_size)
        expected = gather_geometry(seq_lens, rho=rho, bs=bs, W=world_size)
        names = [f"request of {length} tokens ({length // rho} states)" for length in seq_lens.tolist()]
        case = f"stage=9 prefill_geometry W={world_size} rho={rho} bs={bs} (virtual block of {edge} states)"
        run_every_check(
            [
                (
                    field,
                    partial(
                        assert_equal_ints,
                        getattr(geometry, field).cpu(),
                        getattr(expected, field),
                        case=case,
                        what=f"{field} at the virtual-block edges vs the oracle",
                        name_index=names.__getitem__,
                    ),
                )
                for field in ("pages", "bases")
            ]
        )

    run_every_check(
        [
            (f"prefill_geometry at W={world_size} rho={rho} bs={bs}", partial(check_edges, world_size, rho, bs))
            for world_size in (1, 2, 4, 8)
            for rho, bs in ratios_and_pages
        ]
    )


@pytest.mark.world_sizes(1)  # the geometry is a per-step formula: one rank asks it for every W
@pytest.mark.parametrize(
    "ratios_and_pages",
    [
        pytest.param(((4, 2), (128, 4)), id="v40", marks=V40),
        pytest.param(((1, 128), (2, 64)), id="dsv41"),  # vLLM's 128-token page
    ],
)
def test_geometry_at_page_edges(dcp, ratios_and_pages):
    dcp.run(check_geometry_at_page_edges, ratios_and_pages=ratios_and_pages)
