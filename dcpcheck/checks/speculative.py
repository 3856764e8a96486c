"""Speculative (MTP) verification rows checked rank by rank: each request's last
``1 + k`` positions, their KV written and read through the DCP placement.

The GB10 TP2+DCP2 bring-up (tpurtell/ds4fv-vllm-28-sm12x) found a proposer that
computed its slots without ``BlockTables.compute_slot_mappings``, so every rank
wrote and read every global draft token: a greedy correctness probe still
passed, draft acceptance fell from ~68 % to 3-4 %. Here each rank maps the
rows' positions (``slot_mapping``) and filters their top-k (``filter_index``)
with its own block table; both equal the oracle on that rank, and across the
ranks each state a row completes has one writer, its owner.
"""

from __future__ import annotations

import torch

from dcpcheck.checks.partition import gather_from_ranks
from dcpcheck.checks.stage1 import dcp1_producer_batch, filter_on_rank, slot_mapping_on_rank, stage1_slots
from dcpcheck.compare import TokenRows, assert_equal_ints, assert_row_sets_equal, fail_if_problems
from dcpcheck.oracle.layout import owner_of_state, write_slot_mapping
from dcpcheck.scenarios.batch import KvLayout, StepBatch, _BatchBuilder, rank_block_table

# Draft tokens per request: q_len 1 + k, k from vLLM's num_speculative_tokens of 1 to
# DSV4.1's MTP 4 (the production profile's speculative_tokens).
DRAFT_TOKENS = (1, 2, 3, 4)


def speculative_batch(layout: KvLayout, *, top_k: int, seed: int) -> StepBatch:
    """One request per entry of :data:`DRAFT_TOKENS`, each verifying ``1 + k`` rows at its
    end, over several rounds of the ranks (so every rank owns some rows' states)."""
    builder = _BatchBuilder(layout, top_k, torch.Generator().manual_seed(seed))
    for draft in DRAFT_TOKENS:
        request = builder.add_request(states=2 * layout.cycle + builder.randint(layout.cycle) + draft)
        builder.add_rows(request, [("full", "recent")[i % 2] for i in range(1 + draft)], role="spec-decode")
    return builder.build(table_slack=0, table_seed=seed)


def check_speculative_rows(ctx, *, S, bs, rho, K):
    """This rank's writes and reads of the speculative rows against the oracle, and each
    completed state's writers across the ranks."""
    W, r, device = ctx.world_size, ctx.rank, ctx.device
    layout = KvLayout(rho=rho, bs=bs, interleave=S, world_size=W)
    batch = speculative_batch(layout, top_k=K, seed=ctx.seed)
    case = f"speculative rows W={W} S={S} bs={bs} K={K} rho={rho} q_len 1+k, k in {DRAFT_TOKENS} seed={ctx.seed}"
    rows = TokenRows(f"{case}, on rank {r}", batch.token_to_req, batch.row_labels)
    table = rank_block_table(batch, r)
    positions, reqs = batch.positions, batch.token_to_req.long()

    written = slot_mapping_on_rank(ctx.impl, layout, positions, reqs, table, device, rank=r)
    given = batch if W > 1 else dcp1_producer_batch(batch, table)  # W = 1: what a DCP1 indexer hands over
    slots, _ = filter_on_rank(ctx.impl, given, table, device, world_size=W, rank=r)
    writers = gather_from_ranks(ctx, written.long()) >= 0  # [W, T]: the collective before any check

    expected = write_slot_mapping(positions, reqs, table, rho=rho, bs=bs, S=S, W=W, r=r)
    assert_equal_ints(written, expected, case=rows.case, what=f"slot_mapping of the speculative rows on rank {r}",
                      name_index=rows.name)  # fmt: skip
    assert_row_sets_equal(slots, stage1_slots(batch, table, world_size=W, rank=r), rows,
                          what=f"the speculative rows' states read by rank {r} vs the oracle")  # fmt: skip
    completes = (positions + 1) % rho == 0
    owners = owner_of_state((positions + 1) // rho - 1, S, W)
    fail_if_problems(
        rows.case,
        f"writers of each speculative row's state across the {W} ranks",
        [
            f"{rows.name(t)} (position {int(positions[t])}): written by ranks "
            f"{writers[:, t].nonzero().flatten().tolist()}, expected "
            f"{[int(owners[t])] if completes[t] else 'none (it completes no state)'}"
            for t in range(batch.num_tokens)
            if writers[:, t].nonzero().flatten().tolist() != ([int(owners[t])] if completes[t] else [])
        ],
    )
    return {"tokens": batch.num_tokens, "written here": int((written >= 0).sum())}
