"""A rank's stage-1 slots for a :class:`StepBatch`: the implementation's
(checked for shape and dtype) and the oracle's."""

from __future__ import annotations

import torch

from dcpcheck.compare import MismatchError
from dcpcheck.oracle.layout import filter_index_reference
from dcpcheck.scenarios.batch import KvLayout, StepBatch


def filter_on_rank(impl, batch: StepBatch, block_table, device, *, world_size: int, rank: int):
    """The implementation's ``filter_index`` for one rank -> CPU (slots, counts),
    after checking their shape and dtype."""
    slots, counts = impl.filter_index(
        batch.topk.to(device),
        batch.token_to_req.to(device),
        block_table.to(device),
        batch.is_valid_token.to(device),
        bs=batch.layout.bs,
        world_size=world_size,
        rank=rank,
        interleave=batch.layout.interleave,
    )
    for name, tensor, shape in (("slots", slots, tuple(batch.topk.shape)), ("counts", counts, (batch.num_tokens,))):
        if tuple(tensor.shape) != shape or tensor.dtype != torch.int32:
            raise MismatchError(
                f"filter_index (W={world_size}, rank {rank}) returned {name} {tuple(tensor.shape)} "
                f"{tensor.dtype}, expected {shape} torch.int32"
            )
    return slots.cpu(), counts.cpu()


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
