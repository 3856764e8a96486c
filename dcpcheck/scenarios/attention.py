"""Attention inputs for a :class:`~dcpcheck.scenarios.batch.StepBatch`: q,
sinks, the compressed states of every request, and the replicated window.

Like the batch, the inputs do not depend on the rank: every rank builds the
same ones from the same seed, then writes its own compressed cache with
:func:`comp_cache_for` (the DCP1 baseline writes its one with the DCP1 block
table). Built on a GPU, the inputs come from that GPU's generator: the same
on GPUs of one model, not across models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dcpcheck.oracle.layout import owner_of_state, slot_of_state
from dcpcheck.scenarios.batch import StepBatch
from dcpcheck.scenarios.window import window_rows


@dataclass(frozen=True)
class AttentionInputs:
    """One layer's inputs for one step: the data tensors on the device they
    were built on, the index tensors (``state_offsets``, ``swa_slots``) on the CPU."""

    q: torch.Tensor  # [T, H, D], all heads (rank r holds heads [r*H_loc, (r+1)*H_loc))
    sink: torch.Tensor  # [H] fp32, natural-log logits
    states: torch.Tensor  # [sum_i L_i // rho, D]: request i's state c at state_offsets[i] + c
    state_offsets: torch.Tensor  # [R] int64
    swa_cache: torch.Tensor  # [sum_i L_i, D]: every request's token rows, replicated on all ranks
    swa_slots: torch.Tensor  # [T, window] int32: the row's last min(p+1, window) tokens, -1 = none
    scale: float

    @property
    def num_heads(self) -> int:
        return self.q.shape[1]


def build_attention_inputs(
    batch: StepBatch,
    *,
    num_heads: int,
    head_dim: int,
    window: int,
    dtype: torch.dtype,
    seed: int,
    device: torch.device | str = "cpu",
) -> AttentionInputs:
    """Random q, states and window rows in ``dtype``; sinks in [-1, 3], about
    the mass of a few candidates, so a sink counted twice shows. Padding rows
    get no window (their sequence is empty). ``device``: where the random
    tensors are drawn (a realistic profile's are 10^8 elements: seconds of
    host time per rank, milliseconds on a GPU)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    num_states = batch.num_states
    state_offsets = torch.cumsum(num_states, 0) - num_states
    token_offsets = torch.cumsum(batch.seq_lens, 0) - batch.seq_lens

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    q = randn(batch.num_tokens, num_heads, head_dim)
    sink = torch.rand(num_heads, generator=gen, device=device) * 4.0 - 1.0
    states = randn(int(num_states.sum()), head_dim)
    swa_cache = randn(int(batch.seq_lens.sum()), head_dim)

    bases = token_offsets[batch.token_to_req.long()]
    swa_slots = window_rows(batch.positions, batch.is_valid_token, bases, window).to(torch.int32)
    return AttentionInputs(q, sink, states, state_offsets, swa_cache, swa_slots, head_dim**-0.5)


def comp_cache_for(
    batch: StepBatch, inputs: AttentionInputs, block_table: torch.Tensor, *, rank: int, world_size: int
) -> torch.Tensor:
    """The compressed cache of ``rank`` of ``world_size`` (1 = DCP1) with its
    ``block_table``: every state it owns at its slot, NaN in every other row
    so that a read of a slot that holds no candidate poisons the output."""
    layout = batch.layout
    num_states = batch.num_states
    req = torch.repeat_interleave(torch.arange(batch.num_requests), num_states)
    c = torch.arange(req.numel()) - inputs.state_offsets[req]
    owned = owner_of_state(c, layout.interleave, world_size) == rank
    slots = slot_of_state(block_table, c[owned], layout.bs, layout.interleave, world_size, req=req[owned])
    num_rows = (int(block_table.max()) + 1) * layout.bs if block_table.numel() else layout.bs
    cache = torch.full(
        (num_rows, inputs.states.shape[1]), float("nan"), dtype=inputs.states.dtype, device=inputs.states.device
    )
    in_table = slots >= 0  # a page cut from the table (negative slack) holds nothing
    cache[slots[in_table]] = inputs.states[owned][in_table]
    return cache
