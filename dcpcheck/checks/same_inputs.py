"""The check that every rank drew the same random inputs (the realistic GPU
tests' first: a rank's GPU generator depends on its GPU's model), shared by
those tests and their CPU self-test."""

from __future__ import annotations

import torch

from dcpcheck.scenarios.attention import AttentionInputs

SAMPLED_VALUES = 4096  # of each random input, compared bit for bit across ranks


def input_sample(inputs: AttentionInputs) -> torch.Tensor:
    """About SAMPLED_VALUES evenly spaced values of each random input, fp32."""
    tensors = (inputs.q, inputs.sink, inputs.states, inputs.swa_cache)
    return torch.cat([t.flatten()[:: max(1, t.numel() // SAMPLED_VALUES)].float() for t in tensors])


def check_same_inputs(ctx, inputs: AttentionInputs) -> None:
    """Raise unless every rank drew the same random inputs: drawn on each
    rank's GPU, they are the same only on GPUs of one model (torch's CUDA
    generator lays its streams out by the GPU's multiprocessor count)."""
    if ctx.world_size == 1:
        return
    every = ctx.group.all_gather(input_sample(inputs)[None], dim=0)
    differ = [
        r for r in range(ctx.world_size) if not torch.equal(every[r].view(torch.int32), every[0].view(torch.int32))
    ]
    if differ:
        raise RuntimeError(
            f"ranks {differ} drew other random inputs than rank 0 from the same seed (rank {ctx.rank} "
            f"on {_device_name(ctx.device)}): the realistic tests need GPUs of one model"
        )


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
