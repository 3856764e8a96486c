"""Where the ranks of one world size run, and which backend joins them.

Rank r runs on ``cuda:(r % gpus)``. NCCL needs a GPU per rank (it refuses two
ranks on one GPU at init), so when any two ranks share a GPU the ranks use
gloo over CUDA tensors instead: every collective the suite uses works there,
but CUDA graphs cannot capture it. The spawned pool and torchrun's ranks both
place themselves through :class:`Placement`, so the rule lives here once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    device_type: str  # "cpu" or "cuda"
    world_size: int
    gpus: int = 0  # GPUs visible to the ranks (0 on CPU)

    def __post_init__(self):
        if self.device_type == "cuda" and self.gpus < 1:
            raise ValueError("a CUDA placement needs at least one visible GPU")

    @property
    def shares_gpus(self) -> bool:
        return self.device_type == "cuda" and self.world_size > self.gpus

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" and not self.shares_gpus else "gloo"

    @property
    def gpus_used(self) -> int:
        return min(self.world_size, self.gpus) if self.device_type == "cuda" else 0

    @property
    def ranks_per_gpu(self) -> int:
        """Ranks on the busiest GPU (0 on CPU)."""
        return -(-self.world_size // self.gpus) if self.device_type == "cuda" else 0

    def device(self, rank: int) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", rank % self.gpus)
        return torch.device("cpu")

    def describe(self) -> str:
        """``cpu/gloo``, ``cuda/nccl``, or ``cuda/gloo, 8 ranks on 1 GPU``."""
        if not self.shares_gpus:
            return f"{self.device_type}/{self.backend}"
        plural = "s" if self.gpus_used > 1 else ""
        return f"cuda/gloo, {self.world_size} ranks on {self.gpus_used} GPU{plural}"
