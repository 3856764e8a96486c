"""A rank's stage-1 slots for a :class:`StepBatch`: the implementation's
(checked for shape and dtype) and the oracle's."""

from __future__ import annotations

from dataclasses import replace

import torch

from dcpcheck.compare import Expected, assert_outputs
from dcpcheck.impls.conventions import conventions_of, pad_topk
from dcpcheck.oracle.layout import filter_index_reference
from dcpcheck.scenarios.batch import KvLayout, StepBatch


def column_slice(tensor: torch.Tensor, device, *, extra_columns: int = 3, extra_rows: int = 2) -> torch.Tensor:
    """``tensor`` on ``device`` as real callers hand a table over: the leading
    block of a wider and taller buffer (``wide[:rows, :columns]``, row stride
    above the width). The extra cells hold real-looking values (the rows
    rolled), so reading them instead of the view's own cells gives a wrong
    answer, not an obvious crash. Built on ``device``: there a ``.to()``
    would copy a view into a contiguous tensor."""
    rows, columns = tensor.shape
    source = tensor.to(device)
    wide = source.new_zeros(rows + extra_rows, columns + extra_columns)
    wide[:rows, :columns] = source
    shown = min(extra_columns, columns)
    wide[:rows, columns : columns + shown] = source.roll(1, 0)[:, :shown]
    wide[rows : rows + min(extra_rows, rows), :columns] = source[:extra_rows]
    return wide[:rows, :columns]


def filter_on_rank(impl, batch: StepBatch, block_table, device, *, world_size: int, rank: int, views: bool = False):
    """The implementation's ``filter_index`` for one rank -> CPU (slots, counts),
    after checking their shape, dtype and device. ``views``: the top-k and the
    block table are given as column slices of wider buffers (:func:`column_slice`)."""
    multiple = conventions_of(impl).topk_multiple
    topk, table = pad_topk(batch.topk, multiple).to(device), block_table.to(device)
    if views:
        topk, table = column_slice(topk, device), column_slice(table, device)
    ratio = {"rho": batch.layout.rho} if conventions_of(impl).filter_takes_ratio else {}
    result = impl.filter_index(
        topk,
        batch.token_to_req.to(device),
        table,
        batch.is_valid_token.to(device),
        bs=batch.layout.bs,
        world_size=world_size,
        rank=rank,
        interleave=batch.layout.interleave,
        **ratio,
    )
    slots, counts = assert_outputs(
        "filter_index",
        result,
        [Expected("slots", tuple(topk.shape), torch.int32), Expected("counts", (batch.num_tokens,), torch.int32)],
        device=device,
        context=f"W={world_size}, rank {rank}",
    )
    # Only slots[t, :counts[t]] has meaning; the padded tail is the implementation's.
    return meaningful_prefix(slots.cpu(), counts.cpu(), batch.topk.shape[1]), counts.cpu()


def dcp1_producer_batch(batch: StepBatch, table) -> StepBatch:
    """``batch`` as a DCP1 indexer would hand it over: each row's ids are
    states its request has (pages inside ``table``), first, then -1. The
    adversarial rows (-1 anywhere, ids past the table) are for the W > 1
    filter, which de-interleaves global ids; at W = 1 no producer makes them."""
    ids = batch.topk.long()
    keep = (ids >= 0) & (ids // batch.layout.bs < table.shape[1])
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
    compacted = torch.where(torch.gather(keep, 1, order), torch.gather(ids, 1, order), -1)
    return replace(batch, topk=compacted.to(batch.topk.dtype))


def meaningful_prefix(slots: torch.Tensor, counts: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T, top_k]: each row's first ``counts`` slots, -1 after (what a consumer may read)."""
    keep = torch.arange(slots.shape[1])[None, :] < counts.long()[:, None]
    return torch.where(keep, slots, -1)[:, :top_k]


def slot_mapping_on_rank(
    impl, layout: KvLayout, positions, token_to_req, block_table, device, *, rank: int, views: bool = False
):
    """The implementation's ``slot_mapping`` for one rank -> CPU [T] slots,
    int64 as vLLM's cache writes consume them. ``views``: the block table is
    given as a column slice of a wider buffer."""
    table = column_slice(block_table, device) if views else block_table.to(device)
    written = impl.slot_mapping(
        positions.to(device),
        token_to_req.to(torch.int32).to(device),
        table,
        rho=layout.rho,
        bs=layout.bs,
        world_size=layout.world_size,
        rank=rank,
        interleave=layout.interleave,
    )
    assert_outputs(
        "slot_mapping",
        written,
        [Expected("slots", tuple(positions.shape), torch.int64)],
        device=device,
        context=f"W={layout.world_size}, rank {rank}",
    )
    return written.cpu()


def stage1_slots(batch: StepBatch, block_table, *, world_size: int, rank: int) -> torch.Tensor:
    """The rank's candidates from the stage-1 oracle: [T, K] int32, -1 = none."""
    _, slots = filter_index_reference(
        batch.topk, batch.token_to_req, block_table, batch.is_valid_token,
        bs=batch.layout.bs, S=batch.layout.interleave, W=world_size, r=rank,
    )  # fmt: skip
    return slots.to(torch.int32)
