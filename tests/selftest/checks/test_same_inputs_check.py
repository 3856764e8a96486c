"""The realistic GPU tests' first check: every rank drew the same random
inputs (a rank's GPU generator depends on its GPU's model). Here on the CPU,
with a group whose all-gather hands back what each rank drew."""

from __future__ import annotations

import types

import pytest
import torch

from dcpcheck.checks.same_inputs import check_same_inputs, input_sample
from dcpcheck.scenarios.attention import build_attention_inputs
from dcpcheck.scenarios.profiles import SMALL


class GatherOf:
    """Two ranks' group whose all-gather stacks what ``samples_per_rank(rank, this rank's sample)`` gives."""

    def __init__(self, samples_per_rank):
        self.samples_per_rank = samples_per_rank

    def all_gather(self, sample, dim):
        return torch.cat([self.samples_per_rank(rank, sample) for rank in range(2)], dim=dim)


def inputs(seed):
    batch = SMALL.decode_batch(4, 2, seed=0)
    return build_attention_inputs(batch, num_heads=8, head_dim=64, window=8, dtype=torch.bfloat16, seed=seed)


def context(group):
    return types.SimpleNamespace(world_size=2, rank=0, device=torch.device("cpu"), group=group)


def test_ranks_that_drew_the_same_inputs_pass():
    check_same_inputs(context(GatherOf(lambda rank, sample: sample)), inputs(seed=1))


def test_a_rank_that_drew_other_inputs_is_named():
    other = input_sample(inputs(seed=2))[None]
    group = GatherOf(lambda rank, sample: sample if rank == 0 else other)
    with pytest.raises(RuntimeError, match=r"ranks \[1\] drew other random inputs than rank 0"):
        check_same_inputs(context(group), inputs(seed=1))
