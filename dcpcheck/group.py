"""A DCP process group with the vLLM ``GroupCoordinator`` surface.

vLLM's DCP functions take a ``GroupCoordinator``; this object offers the part
of that surface they use, so they can be called with it unchanged, and the
embedded port uses the same methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class DcpGroup:
    rank_in_group: int
    world_size: int
    device: torch.device
    device_group: dist.ProcessGroup | None
    cpu_group: dist.ProcessGroup | None
    unique_name: str = "dcp"
    # How many collectives went through this object: the gate must raise
    # before the first one.
    collective_calls: int = field(default=0, compare=False)

    @classmethod
    def single_rank(cls, device: torch.device) -> DcpGroup:
        """A W = 1 group on ``device``: an implementation's own DCP1 path, no collective."""
        return cls(rank_in_group=0, world_size=1, device=device, device_group=None, cpu_group=None)

    @property
    def rank(self) -> int:
        return self.rank_in_group

    @property
    def ranks(self) -> list[int]:
        return list(range(self.world_size))

    @property
    def local_rank(self) -> int:
        return self.device.index if self.device.type == "cuda" else self.rank_in_group

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def _count(self) -> None:
        self.collective_calls += 1

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``input_`` along ``dim``, in rank order."""
        if self.world_size == 1:
            return input_
        self._count()
        dim = dim % input_.dim()
        # gloo wants the flat [W * n0, ...] output; NCCL accepts it too.
        flat = torch.empty(
            (self.world_size * input_.shape[0],) + tuple(input_.shape[1:]), dtype=input_.dtype, device=input_.device
        )
        dist.all_gather_into_tensor(flat, input_.contiguous(), group=self.device_group)
        # [W, ..., n, ...] -> [..., W*n, ...]: rank blocks stay contiguous on dim.
        gathered = flat.view((self.world_size,) + tuple(input_.shape))
        return gathered.movedim(0, dim).flatten(dim, dim + 1)

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Sum over ranks, then keep this rank's 1/W slice of ``dim``."""
        if self.world_size == 1:
            return input_
        self._count()
        dim = dim % input_.dim()
        if input_.shape[dim] % self.world_size:
            raise ValueError(
                f"reduce_scatter over dim {dim} of size {input_.shape[dim]}: the "
                f"size must be a multiple of the world size {self.world_size}"
            )
        leading = input_.movedim(dim, 0).contiguous()
        out = torch.empty(
            (leading.shape[0] // self.world_size,) + tuple(leading.shape[1:]),
            dtype=input_.dtype,
            device=input_.device,
        )
        dist.reduce_scatter_tensor(out, leading, group=self.device_group)
        return out.movedim(0, dim).contiguous()

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return input_
        self._count()
        dist.all_reduce(input_, group=self.device_group)
        return input_

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size == 1:
            return input_
        self._count()
        dist.broadcast(input_, src=src, group=self.device_group)
        return input_

    def barrier(self) -> None:
        if self.world_size > 1:
            self._count()
            dist.barrier(group=self.cpu_group)
