"""Two consecutive served steps at the production profile through one layer, the second reading what the
first wrote (:func:`dcpcheck.scenarios.production.production_trace`).

The e2e serving traces (:mod:`dcpcheck.checks.serving_trace`) write every token of a request through the
stack from position 0 and draw every token's query up front: positions past 2^17 would take thousands of
steps and, at head dim 512, tens of GB of queries. So the requests' earlier tokens are in the caches when the
trace starts (a prefix the steps before wrote, placed by the oracle as :func:`comp_cache_for` places it), and
every state and window row the trace's own rows complete starts as NaN: the layer must write it through its
sharded write path (``forward``'s ``kv`` and ``states``) before a row of that step or the next reads it.
"""

from __future__ import annotations

import torch

from dcpcheck.checks.cases import checked_layer_output, own_heads
from dcpcheck.checks.production import (
    assert_matches_oracle,
    is_prefill_request,
    production_context,
    production_inputs,
    production_layer,
)
from dcpcheck.oracle.layout import owner_of_state, slot_of_state
from dcpcheck.scenarios.attention import comp_cache_for
from dcpcheck.scenarios.batch import StepBatch, rank_block_table
from dcpcheck.scenarios.production import PROFILES, production_trace
from dcpcheck.scenarios.window import window_rows


def check_production_trace(
    ctx, *, profile: str, rho: int, top_k: int, local_heads: int, prefill_gather: bool, interleave_tokens: int = 1
) -> dict:
    """Each step's layer output for this rank's heads vs the float64 oracle, at ``profile`` (a name of
    :data:`~dcpcheck.scenarios.production.PROFILES`). -> the worst comparison over the steps."""
    profile = PROFILES[profile]
    W, device = ctx.world_size, ctx.device
    layout = profile.kv_layout(rho, W, interleave_tokens)
    steps = production_trace(profile, layout, top_k=top_k, seed=ctx.seed)
    final = steps[-1]  # every request at its last length: the states and window rows the trace reads
    num_heads = local_heads * W
    inputs, tolerance_dtype = production_inputs(ctx, profile, final, num_heads)
    heads = own_heads(ctx, num_heads)
    table = rank_block_table(final, ctx.rank)  # each request's pages for the whole trace, from step 1 on
    token_offsets = torch.cumsum(final.seq_lens, 0) - final.seq_lens
    comp_cache = comp_cache_for(final, inputs, table, rank=ctx.rank, world_size=W)
    swa_cache = inputs.swa_cache.clone()  # the layer's buffer; the oracle reads inputs.swa_cache
    for step in steps:
        window_slots, state_slots = written_by(step, table, token_offsets, rank=ctx.rank)
        swa_cache[window_slots.to(device)] = float("nan")
        comp_cache[state_slots.to(device)] = float("nan")

    layer = production_layer(ctx, profile, layout, top_k=top_k, prefill_gather=prefill_gather)
    context = production_context(ctx, profile, rho=rho, top_k=top_k, num_heads=num_heads, prefill_gather=prefill_gather)
    queries = torch.Generator(device=device).manual_seed(ctx.seed + 2)
    worst = {"worst_ratio": 0.0, "max_abs_err": 0.0}
    for index, step in enumerate(steps):
        bases = token_offsets[step.token_to_req.long()]
        swa_slots = window_rows(step.positions, step.is_valid_token, bases, profile.window).to(torch.int32)
        valid = step.is_valid_token
        plan = layer.plan_step(
            seq_lens=step.seq_lens.to(device),
            token_to_req=step.token_to_req.to(device),
            positions=step.positions.to(device),
            is_valid_token=valid.to(device),
            is_prefill_request=is_prefill_request(step).to(device),
            swa_slots=swa_slots.to(device),
            swa_write_slots=torch.where(valid, bases + step.positions, -1).to(device),
            block_table=table.to(device),
        )
        q = torch.randn(step.num_tokens, num_heads, profile.head_dim, generator=queries, device=device)
        q = q.to(tolerance_dtype).to(inputs.q.dtype)  # rounded as production_inputs rounds the step's q
        out = layer.forward(
            plan,
            q=q[:, heads],
            sink=inputs.sink[heads].to(device),
            swa_cache=swa_cache,
            comp_cache=comp_cache,
            topk=step.topk.to(device),
            kv=inputs.swa_cache[(bases + step.positions).to(device)],
            states=completed_states(step, inputs, layout.rho).to(device),
        )
        out = checked_layer_output(out, q[:, heads], device)
        stats = assert_matches_oracle(
            out,
            step,
            inputs,
            q,
            swa_slots,
            heads,
            context={**context, "step": f"{index + 1} of {len(steps)}"},
            tolerance_dtype=tolerance_dtype,
        )
        worst = {name: max(worst[name], getattr(stats, name)) for name in worst}
    return worst


def written_by(step: StepBatch, table, token_offsets, *, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``step``'s rows write on ``rank``: -> (window rows of the dense window buffer, compressed-cache
    slots of the states they complete that ``rank`` owns)."""
    layout = step.layout
    valid = step.is_valid_token
    positions, reqs = step.positions[valid], step.token_to_req[valid].long()
    completes = (positions + 1) % layout.rho == 0
    states, state_reqs = positions[completes] // layout.rho, reqs[completes]
    owned = owner_of_state(states, layout.interleave, layout.world_size) == rank
    slots = slot_of_state(table, states[owned], layout.bs, layout.interleave, layout.world_size, req=state_reqs[owned])
    return token_offsets[reqs] + positions, slots[slots >= 0]


def completed_states(step: StepBatch, inputs, rho: int) -> torch.Tensor:
    """[T, D]: the state each row's position completes, NaN where none does (and on padding rows)."""
    positions, reqs = step.positions, step.token_to_req.long()
    completes = step.is_valid_token & ((positions + 1) % rho == 0)
    index = torch.where(completes, inputs.state_offsets[reqs] + positions // rho, 0)
    states = inputs.states[index.to(inputs.states.device)]
    return torch.where(completes.to(states.device)[:, None], states, float("nan"))
