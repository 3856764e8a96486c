"""The stage-1 partition check one rank runs (tests/stage1_index, and the GPU
test at the realistic profile): the ranks' filtered top-k partitions the DCP1
set, and what a rank reads is where it (and only it) writes.

Every rank filters the same batch with its own block table, maps its slots
back to state ids through that table, and all-gathers them; then every rank
checks the whole partition against the float64/int64 oracle and against the
implementation's own W = 1 path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dcpcheck.checks.stage1 import dcp1_producer_batch, filter_on_rank, slot_mapping_on_rank
from dcpcheck.compare import (
    TokenRows,
    assert_compact_prefix,
    assert_equal_ints,
    assert_row_sets_equal,
    assert_rows_disjoint,
    fail_if_problems,
)
from dcpcheck.oracle.layout import (
    filter_index_reference,
    local_index,
    owner_of_state,
    state_of_slot,
    write_slot_mapping,
)
from dcpcheck.scenarios.batch import KvLayout, StepBatch, build_step_batch, dcp1_block_table, rank_block_table


class WriteProbe:
    """Positions to ask ``slot_mapping`` about: first the one completing each
    state of each request (``(c + 1) * rho - 1``), then one inside each
    state that completes nothing, then the batch's own rows."""

    def __init__(self, batch: StepBatch):
        rho = batch.layout.rho
        num_states = batch.num_states
        self.first_state = torch.cumsum(num_states, 0) - num_states  # [R] index of state 0
        self.state_reqs = torch.repeat_interleave(torch.arange(batch.num_requests), num_states)
        self.states = torch.arange(self.state_reqs.numel()) - self.first_state[self.state_reqs]
        completing = (self.states + 1) * rho - 1
        inside = completing - 1 if rho > 1 else torch.empty(0, dtype=torch.int64)
        self.num_completing = completing.numel()
        self.positions = torch.cat([completing, inside, batch.positions])
        self.reqs = torch.cat([self.state_reqs, self.state_reqs[: inside.numel()], batch.token_to_req.long()])

    def name(self, i: int) -> str:
        req, position = int(self.reqs[i]), int(self.positions[i])
        if i < self.num_completing:
            return f"request {req} state {int(self.states[i])} (position {position})"
        return f"request {req} position {position} (completes no state)"


def gather_from_ranks(ctx, tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` stacked in rank order: CPU ``[W, *tensor.shape]``.
    Plain torch.distributed on the group's device group: stage 1 checks the
    filter, not the harness's collectives."""
    if ctx.world_size == 1:
        return tensor.unsqueeze(0)
    parts = [torch.empty_like(tensor, device=ctx.device) for _ in range(ctx.world_size)]
    dist.all_gather(parts, tensor.to(ctx.device).contiguous(), group=ctx.group.device_group)
    return torch.stack(parts).cpu()


@dataclass
class RankReads:
    """What one rank read, and what all ranks read (gathered)."""

    slots: torch.Tensor  # [T, K] int32, this rank's filter output
    counts: torch.Tensor  # [T] int32
    states: torch.Tensor  # [T, K] int64: slots mapped back through this rank's block table
    all_states: torch.Tensor  # [W, T, K]
    all_counts: torch.Tensor  # [W, T]


def check_partition(ctx, *, S, bs, K, rho, table_slack, num_decodes, views=False):
    """``views``: the top-k and the block tables are handed over as column
    slices of wider buffers, as engines pass them; every check still holds,
    and the results equal those of contiguous inputs."""
    W = ctx.world_size
    layout = KvLayout(rho=rho, bs=bs, interleave=S, world_size=W)
    batch = build_step_batch(layout, top_k=K, seed=ctx.seed, num_decodes=num_decodes, table_slack=table_slack)
    case = (
        f"stage 1 case W={W} S={S} bs={bs} K={K} rho={rho} table_slack={table_slack} "
        f"num_decodes={num_decodes} views={views} seed={ctx.seed}, on rank {ctx.rank}"
    )
    tables = [rank_block_table(batch, rank) for rank in range(W)]
    result = check_partition_of_batch(ctx, batch, tables, case, views=views)
    if table_slack < 0 and result["dropped"] == 0:
        raise AssertionError(f"{case}: table_slack < 0 but no top-k id falls on a cut page")
    return result


def check_partition_of_batch(ctx, batch: StepBatch, tables: list[torch.Tensor], case: str, *, views=False) -> dict:
    """The partition checks of ``batch`` with every rank's block table ``tables`` (the production
    profile's stage-1 cases give vLLM's served rows here). -> counts of what the case covered."""
    W, r, device = ctx.world_size, ctx.rank, ctx.device
    layout = batch.layout
    S, bs = layout.interleave, layout.bs
    rows = TokenRows(case, batch.token_to_req, batch.row_labels)
    probe = WriteProbe(batch)

    # The implementation runs, then the collectives, then the checks: a rank
    # that finds a mismatch must not leave its peers waiting in a collective.
    # W = 1 is the DCP1 baseline: it gets what a DCP1 indexer produces.
    given = batch if W > 1 else dcp1_producer_batch(batch, tables[r])
    slots, counts = filter_on_rank(ctx.impl, given, tables[r], device, world_size=W, rank=r, views=views)
    written = slot_mapping_on_rank(
        ctx.impl, layout, probe.positions, probe.reqs, tables[r], device, rank=r, views=views
    )
    if views:
        plain_slots, plain_counts = filter_on_rank(ctx.impl, given, tables[r], device, world_size=W, rank=r)
        plain_written = slot_mapping_on_rank(ctx.impl, layout, probe.positions, probe.reqs, tables[r], device, rank=r)
    states = state_of_slot(tables[r], slots, bs, S, W, r, req=batch.token_to_req.unsqueeze(1))
    reads = RankReads(slots, counts, states, gather_from_ranks(ctx, states), gather_from_ranks(ctx, counts.long()))
    all_written = gather_from_ranks(ctx, written[: probe.num_completing].long())

    widths = torch.tensor([table.shape[1] for table in tables])

    def on_kept_page(c: torch.Tensor) -> torch.Tensor:
        """Whether state ``c``'s page is inside its owner's block table row."""
        return (c >= 0) & (local_index(c, S, W) // bs < widths[owner_of_state(c, S, W).clamp(min=0)])

    if views:
        what = "given column-slice views vs contiguous inputs"
        assert_row_sets_equal(slots, plain_slots, rows, what=f"filter_index slots {what}")
        assert_equal_ints(counts, plain_counts, case=case, what=f"filter_index counts {what}", name_index=rows.name)
        assert_equal_ints(written, plain_written, case=case, what=f"slot_mapping {what}", name_index=probe.name)
    check_own_reads(batch, tables[r], reads, rows, rank=r)
    dcp1_owned = check_partition_of_dcp1(ctx, batch, reads, on_kept_page, rows)
    check_write_side(batch, tables[r], reads, written, all_written, probe, on_kept_page, rows, rank=r)

    # The scenario still covers what it claims to.
    dropped = int((dcp1_owned & ~on_kept_page(batch.topk.long())).sum())
    empty_shards = int(((reads.all_counts == 0) & (dcp1_owned.sum(1) > 0)).sum())
    if W > 1 and empty_shards == 0:
        raise AssertionError(f"{case}: no row leaves a rank without an owned state")
    return {"tokens": batch.num_tokens, "read": int(counts.sum()), "dropped": dropped, "empty_shards": empty_shards}


def check_own_reads(batch: StepBatch, table, reads: RankReads, rows: TokenRows, *, rank: int) -> None:
    """This rank's filter output: compact, nothing for padding rows, only its
    requests' pages, exactly the states the oracle says it owns."""
    layout = batch.layout
    assert_compact_prefix(reads.slots, reads.counts, rows, what=f"rank {rank}'s slots")
    assert_equal_ints(
        reads.counts,
        torch.where(batch.is_valid_token, reads.counts, 0),
        case=rows.case,
        what="invalid (padding) tokens must have count 0",
        name_index=rows.name,
    )
    fail_if_problems(
        rows.case,
        "slots outside the request's pages",
        [
            f"{rows.name(t)}: slot {int(reads.slots[t, k])} is on no page of request "
            f"{rows.requests[t]} in rank {rank}'s block table"
            for t, k in ((reads.slots >= 0) & (reads.states < 0)).nonzero().tolist()
        ],
    )
    owned, _ = filter_index_reference(
        batch.topk,
        batch.token_to_req,
        table,
        batch.is_valid_token,
        bs=layout.bs,
        S=layout.interleave,
        W=layout.world_size,
        r=rank,
    )
    assert_row_sets_equal(
        reads.states,
        torch.where(owned, batch.topk.long(), -1),
        rows,
        what=f"states read by rank {rank} vs the oracle (owner(c) = (c // S) % W, page inside the row)",
    )


def check_partition_of_dcp1(ctx, batch: StepBatch, reads: RankReads, on_kept_page, rows: TokenRows) -> torch.Tensor:
    """Across ranks: no state read twice, the union is the DCP1 set less the
    ids on cut pages, the counts add up. Returns the oracle's DCP1 mask [T, K]."""
    layout, W = batch.layout, ctx.world_size
    dcp1_table = dcp1_block_table(batch)
    ids = batch.topk.long()
    dcp1_owned, dcp1_slots = filter_index_reference(
        batch.topk, batch.token_to_req, dcp1_table, batch.is_valid_token, bs=layout.bs, S=layout.interleave, W=1, r=0
    )
    kept = on_kept_page(ids)
    union = reads.all_states.permute(1, 0, 2).reshape(batch.num_tokens, -1)
    assert_rows_disjoint(reads.all_states, rows, what="states read by two ranks")
    assert_row_sets_equal(
        union,
        torch.where(dcp1_owned & kept, ids, -1),
        rows,
        what=f"union over the {W} ranks vs the oracle DCP1 set (less cut pages)",
    )
    assert_equal_ints(
        reads.all_counts.sum(0),
        (dcp1_owned & kept).sum(1),
        case=rows.case,
        what=f"counts summed over the {W} ranks vs the DCP1 count",
        name_index=rows.name,
    )
    # The implementation's own W = 1 path is the same on every rank: rank 0 checks it.
    if ctx.rank == 0:
        impl_slots, impl_counts = filter_on_rank(
            ctx.impl, dcp1_producer_batch(batch, dcp1_table), dcp1_table, ctx.device, world_size=1, rank=0
        )
        assert_compact_prefix(impl_slots, impl_counts, rows, what="the implementation's W=1 slots")
        assert_row_sets_equal(
            impl_slots, dcp1_slots, rows, what="slots of the implementation's W=1 path vs the oracle DCP1"
        )
        impl_states = state_of_slot(
            dcp1_table, impl_slots, layout.bs, layout.interleave, 1, 0, req=batch.token_to_req.unsqueeze(1)
        )
        assert_row_sets_equal(
            union,
            torch.where(on_kept_page(impl_states), impl_states, -1),
            rows,
            what=f"union over the {W} ranks vs the implementation's W=1 set (less cut pages)",
        )
    return dcp1_owned


def check_write_side(
    batch: StepBatch,
    table,
    reads: RankReads,
    written,
    all_written,
    probe: WriteProbe,
    on_kept_page,
    rows: TokenRows,
    *,
    rank: int,
) -> None:
    """``slot_mapping`` equals the oracle on this rank, writes every state
    this rank reads exactly where it reads it, and each state has one writer:
    its owner (none when its page is cut from the row)."""
    layout = batch.layout
    expected = write_slot_mapping(
        probe.positions,
        probe.reqs,
        table,
        rho=layout.rho,
        bs=layout.bs,
        S=layout.interleave,
        W=layout.world_size,
        r=rank,
    )
    assert_equal_ints(
        written, expected, case=rows.case, what=f"slot_mapping on rank {rank} vs the oracle", name_index=probe.name
    )

    row_reqs = batch.token_to_req.long().unsqueeze(1)
    # Slots of no state of the row's request were reported by check_own_reads.
    comparable = (reads.slots >= 0) & (reads.states >= 0) & (reads.states < batch.num_states[row_reqs])
    write_index = torch.where(comparable, probe.first_state[row_reqs] + reads.states, 0)
    written_there = written[write_index]
    fail_if_problems(
        rows.case,
        f"read side vs write side on rank {rank}",
        [
            f"{rows.name(t)}: filter reads state {int(reads.states[t, k])} at slot {int(reads.slots[t, k])}, "
            f"slot_mapping writes {probe.name(int(write_index[t, k]))} to slot {int(written_there[t, k])}"
            for t, k in (comparable & (written_there != reads.slots)).nonzero().tolist()
        ],
    )

    writers = all_written >= 0  # [W, states]
    owners = owner_of_state(probe.states, layout.interleave, layout.world_size)
    kept = on_kept_page(probe.states)
    owner_writes = writers[owners, torch.arange(probe.num_completing)]
    wrong = (writers.sum(0) != kept.long()) | (kept & ~owner_writes)
    fail_if_problems(
        rows.case,
        f"writers of each state across the {layout.world_size} ranks",
        [
            f"{probe.name(i)}: written by ranks {writers[:, i].nonzero().flatten().tolist()}, "
            f"expected {[int(owners[i])] if kept[i] else 'none (page cut from the row)'}"
            for i in wrong.nonzero().flatten().tolist()
        ],
    )
