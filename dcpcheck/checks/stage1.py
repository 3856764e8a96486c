"""A rank's stage-1 slots for a :class:`StepBatch`: the implementation's
(checked for shape and dtype) and the oracle's."""

from __future__ import annotations

from dataclasses import replace

import torch

from dcpcheck.compare import MismatchError
from dcpcheck.impls.conventions import conventions_of, pad_topk
from dcpcheck.oracle.layout import filter_index_reference
from dcpcheck.scenarios.batch import KvLayout, StepBatch


def filter_on_rank(impl, batch: StepBatch, block_table, device, *, world_size: int, rank: int):
    """The implementation's ``filter_index`` for one rank -> CPU (slots, counts),
    after checking their shape and dtype."""
    multiple = conventions_of(impl).topk_multiple
    slots, counts = impl.filter_index(
        pad_topk(batch.topk, multiple).to(device),
        batch.token_to_req.to(device),
        block_table.to(device),
        batch.is_valid_token.to(device),
        bs=batch.layout.bs,
        world_size=world_size,
        rank=rank,
        interleave=batch.layout.interleave,
    )
    padded_shape = (batch.num_tokens, pad_topk(batch.topk[:0], multiple).shape[1])
    for name, tensor, shape in (("slots", slots, padded_shape), ("counts", counts, (batch.num_tokens,))):
        if tuple(tensor.shape) != shape or tensor.dtype != torch.int32:
            raise MismatchError(
                f"filter_index (W={world_size}, rank {rank}) returned {name} {tuple(tensor.shape)} "
                f"{tensor.dtype}, expected {shape} torch.int32"
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


def slot_mapping_on_rank(impl, layout: KvLayout, positions, token_to_req, block_table, device, *, rank: int):
    """The implementation's ``slot_mapping`` for one rank -> CPU [T] slots."""
    written = impl.slot_mapping(
        positions.to(device),
        token_to_req.to(torch.int32).to(device),
        block_table.to(device),
        rho=layout.rho,
        bs=layout.bs,
        world_size=layout.world_size,
        rank=rank,
        interleave=layout.interleave,
    )
    if tuple(written.shape) != tuple(positions.shape):
        raise MismatchError(
            f"slot_mapping (W={layout.world_size}, rank {rank}) returned shape {tuple(written.shape)}, "
            f"expected {tuple(positions.shape)}"
        )
    return written.cpu()


def stage1_slots(batch: StepBatch, block_table, *, world_size: int, rank: int) -> torch.Tensor:
    """The rank's candidates from the stage-1 oracle: [T, K] int32, -1 = none."""
    _, slots = filter_index_reference(
        batch.topk, batch.token_to_req, block_table, batch.is_valid_token,
        bs=batch.layout.bs, S=batch.layout.interleave, W=world_size, r=rank,
    )  # fmt: skip
    return slots.to(torch.int32)
