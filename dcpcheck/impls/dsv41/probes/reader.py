"""Does the port's read side (``_compressed_topk_to_slots``) read each compressed state where
vLLM's DCP writer put it?"""

from __future__ import annotations

import torch

from dcpcheck.impls.dsv41.probes.common import (
    PROBE_INTERLEAVE_TOKENS,
    PROBE_PAGE_TOKENS,
    PROBE_RATIO,
    PROBE_TOKENS,
    PROBE_WORLD_SIZE,
    probe_request,
)
from dcpcheck.impls.dsv41.probes.writer import dcp_writer_slots


def reader_finding(build_layer, vllm) -> str | None:
    """Does the port's read side (``_compressed_topk_to_slots``) read each state where vLLM's DCP
    writer put it? ``build_layer(rank, rho)``: a layer of the probe's layout (asked at PROBE_RATIO). None if it does."""
    num_states = PROBE_TOKENS // PROBE_RATIO
    problems = []
    for rank in range(PROBE_WORLD_SIZE):
        _, _, block_table = probe_request(rank)
        written = dcp_writer_slots(vllm, rank)
        # State c is written by its last token, position (c + 1) * ratio - 1 (-1: on another rank).
        state_slots = written[PROBE_RATIO - 1 :: PROBE_RATIO]
        layer = build_layer(rank, PROBE_RATIO)
        device = block_table.device
        # One row per state, each asking for that state alone: the compacted
        # output then says which slot the read side gives each state.
        topk = torch.full((num_states, layer.topk_indices_buffer.shape[1]), -1, dtype=torch.int32, device=device)
        topk[:, 0] = torch.arange(num_states, device=device)
        try:
            slots, lens = layer._compressed_topk_to_slots(
                topk,
                torch.zeros(num_states, dtype=torch.int32, device=device),
                block_table,
                PROBE_PAGE_TOKENS // PROBE_RATIO,
                torch.ones(num_states, dtype=torch.bool, device=device),
            )
        except (AssertionError, ValueError, RuntimeError) as exc:
            problems.append(f"rank {rank} raised {type(exc).__name__}: {exc}")
            continue
        read = torch.where(lens > 0, slots[:, 0].long(), -1)
        misplaced = int((read != state_slots).sum())
        if misplaced:
            problems.append(
                f"rank {rank} reads {misplaced} of the {num_states} states elsewhere than they were written"
            )
    if not problems:
        return None
    return (
        f"at W={PROBE_WORLD_SIZE}, compress ratio {PROBE_RATIO} and a {PROBE_INTERLEAVE_TOKENS}-token interleave "
        f"(one state per rank in turn), each of {num_states} states asked alone: " + "; ".join(problems)
    )
