"""Counting what a fused implementation does, by the collectives it makes.

An implementation that fuses the prefill geometry, gather and remap into its
layer (the seed DCP2 port does) has no capability to spy on; what it moves
through the group is observable whatever its decomposition.
"""

from __future__ import annotations

import torch


class CountingGroup:
    """The group, with every ``all_gather`` of a >= 3-D tensor along dim 0
    (a gather of KV pages; q gathers are along heads, LSE and sink gathers
    are 1-D or 2-D) counted in rows of its last dim.

    An implementation that hands its layer another group object over the same
    process group (dsv41: the tree's ``GroupCoordinator``) finds the group
    underneath in ``wrapped`` and reports each all-gather that object makes to
    ``observe_all_gather``."""

    def __init__(self, group):
        self._group = group
        self.gathered_kv_rows = 0

    def __getattr__(self, name):
        return getattr(self._group, name)

    @property
    def wrapped(self):
        return self._group

    def observe_all_gather(self, tensor: torch.Tensor, dim: int = -1) -> None:
        if tensor.dim() >= 3 and dim % tensor.dim() == 0:
            self.gathered_kv_rows += tensor.numel() // tensor.shape[-1]

    def all_gather(self, tensor: torch.Tensor, dim: int = -1):
        self.observe_all_gather(tensor, dim)
        return self._group.all_gather(tensor, dim)
