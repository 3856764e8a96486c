"""The tree's token slot mapping, checked wherever a step computes it.

vLLM's runner maps each scheduled token to its KV slot on this rank with
``BlockTable.compute_slot_mapping`` (``v1/worker/block_table.py``, its
``ComputeSlotMappingKernel``: under DCP the token at position ``p`` is this
rank's when ``(p % (page * W)) // interleave % W`` is its rank, else
``PAD_SLOT_ID``). The compressed metadata builder takes that mapping as it is
at compress ratio 1 and as its pad guard at ratio 2. Where the tree's builder
places no state by DCP (finding 4) vLLM's DCP writer writes instead, and the
builder's output is not used at W > 1: this check reads the tree's mapping
itself, at every W, so a bug in it cannot hide behind that stand-in.
"""

from __future__ import annotations

import torch

from dcpcheck.compare import MismatchError
from dcpcheck.oracle.layout import write_slot_mapping

KERNEL = "v1/worker/block_table.py ComputeSlotMappingKernel (BlockTable.compute_slot_mapping)"


def tree_token_slots(
    vllm,
    positions,
    token_to_req,
    block_table,
    *,
    tokens_per_page: int,
    token_interleave: int,
    world_size: int,
    rank: int,
) -> torch.Tensor:
    """The tree's token slot mapping of the asked rows (``vllm``: the adapter over the tree's vLLM), checked."""
    token_slots = vllm.token_slots(
        positions,
        token_to_req,
        block_table,
        tokens_per_page=tokens_per_page,
        world_size=world_size,
        rank=rank,
        token_interleave=token_interleave,
    )
    check_token_slots(
        token_slots,
        positions,
        token_to_req,
        block_table,
        tokens_per_page=tokens_per_page,
        token_interleave=token_interleave,
        world_size=world_size,
        rank=rank,
    )
    return token_slots


def check_token_slots(
    token_slots: torch.Tensor,
    positions: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    *,
    tokens_per_page: int,
    token_interleave: int,
    world_size: int,
    rank: int,
) -> None:
    """Raise :class:`MismatchError` where the tree's ``token_slots`` ([T], -1 for another rank's token or a
    padding row, whose position is -1) are not DCP's placement of the tokens (``dcpcheck/oracle/layout.py``:
    a ratio-1 cache of ``tokens_per_page``-token pages, ``token_interleave`` tokens a rank in turn)."""
    expected = write_slot_mapping(
        positions.cpu(),
        token_to_req.cpu(),
        block_table.cpu(),
        rho=1,
        bs=tokens_per_page,
        S=token_interleave,
        W=world_size,
        r=rank,
    )
    actual = token_slots.cpu().to(torch.int64)
    wrong = (actual != expected).nonzero().flatten()
    if not wrong.numel():
        return
    first = int(wrong[0])
    raise MismatchError(
        f"the tree's token slot mapping ({KERNEL}) vs DCP's placement (dcpcheck/oracle/layout.py) on rank {rank} "
        f"at W={world_size}, {tokens_per_page}-token pages, a {token_interleave}-token interleave: "
        f"{wrong.numel()} of {actual.numel()} token rows differ, first position {int(positions[first])} of request "
        f"{int(token_to_req[first])}: slot {int(actual[first])}, expected {int(expected[first])}"
    )
