"""Which window-buffer rows a step's rows read."""

from __future__ import annotations

import torch


def window_rows(
    positions: torch.Tensor, is_valid_token: torch.Tensor, bases: torch.Tensor, window: int
) -> torch.Tensor:
    """Rows read by each row of a step whose request's token ``p`` sits at row
    ``bases[t] + p``: the row's last ``min(p + 1, window)`` tokens ->
    [T, window] int64, -1 = none (and every entry of a padding row)."""
    window_positions = positions[:, None] - window + 1 + torch.arange(window, device=positions.device)
    readable = (window_positions >= 0) & is_valid_token[:, None]
    return torch.where(readable, bases[:, None] + window_positions, -1)
