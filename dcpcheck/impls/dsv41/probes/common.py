"""What every serving probe shares: the probe's layout (W = 2, compress ratio 2, a 2-token
interleave, one state per rank in turn: the smallest case where tokens and states differ),
where it runs, its request, and a local stand-in for the DCP group's all-gather."""

from __future__ import annotations

import torch

PROBE_WORLD_SIZE = 2
PROBE_RATIO = 2
PROBE_INTERLEAVE_TOKENS = 2
PROBE_PAGE_TOKENS = 8
PROBE_TOKENS = 32
PROBE_TABLE_WIDTH = 8  # wider than a rank's pages: the columns after them are the null page, as vLLM's rows


def probe_device() -> torch.device:
    """Where the probes run: vLLM's kernels are compiled for the GPU where there is one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def probe_request(rank: int):
    """One request of PROBE_TOKENS tokens on ``rank``: positions, its rows, and a block table
    whose first pages are the rank's (pages 1, 2, ...), the rest the null page 0."""
    device = probe_device()
    positions = torch.arange(PROBE_TOKENS, device=device)
    token_to_req = torch.zeros(PROBE_TOKENS, dtype=torch.int32, device=device)
    block_table = torch.zeros((1, PROBE_TABLE_WIDTH), dtype=torch.int32, device=device)
    local_pages = -(-PROBE_TOKENS // (PROBE_PAGE_TOKENS * PROBE_WORLD_SIZE))
    block_table[0, :local_pages] = torch.arange(1, local_pages + 1, device=device) + 10 * rank
    return positions, token_to_req, block_table


class LocalAllGather:
    """A DCP group whose all-gather stacks W copies of this rank's part: the
    gather's collective, for a single-process measurement of what surrounds it."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return torch.cat([tensor] * self.world_size, dim=dim)
