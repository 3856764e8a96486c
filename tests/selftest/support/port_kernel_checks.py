"""One check of the port's Triton kernels per stage, on small inputs against
the oracle: each asserts and returns the kernels' outputs. Run under the
interpreter by ``test_interpreter_kernels.py`` (in a CPU-only subprocess
where the test process compiles for a GPU: :func:`run_checks`) and compared
with the interpreter as shipped by ``test_interpreter_patching.py``."""

from __future__ import annotations

import json
import math
import traceback
from unittest import mock

import torch

from dcpcheck.oracle.attention import merge_partials
from dcpcheck.oracle.layout import filter_index_reference, write_slot_mapping
from dcpcheck.oracle.prefill import gather_geometry, remap_reference
from dcpcheck.port.combine import combine
from dcpcheck.port.index import filter_index, slot_mapping
from dcpcheck.port.prefill import prefill_geometry, prefill_remap
from dcpcheck.port.triton_env import TOPK_TILE

TOP_K = 2 * TOPK_TILE + 44  # three tiles of the top-k loops, the last one partial
WORLD, RANK, BS, INTERLEAVE = 2, 1, 8, 2


def _topk(num_tokens: int, num_states: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(num_states, generator=generator)[:TOP_K] for _ in range(num_tokens)])
    return ids.masked_fill(torch.rand(ids.shape, generator=generator) < 0.2, -1)


def check_stage1() -> tuple[torch.Tensor, ...]:
    num_tokens, num_states = 5, 400
    topk = _topk(num_tokens, num_states)
    token_to_req = torch.tensor([0, 1, 0, 1, 1])
    is_valid = torch.tensor([True, True, False, True, True])
    pages = math.ceil(num_states / (WORLD * BS))
    block_table = torch.randperm(2 * pages, generator=torch.Generator().manual_seed(1)).view(2, pages).int()
    block_table = block_table[:, : pages - 3]  # a cut row: the last pages' ids are dropped
    layout = {"bs": BS, "world_size": WORLD, "rank": RANK, "interleave": INTERLEAVE}
    slots, counts = filter_index(topk, token_to_req, block_table, is_valid, **layout)
    owned, expected = filter_index_reference(
        topk, token_to_req, block_table, is_valid, bs=BS, S=INTERLEAVE, W=WORLD, r=RANK
    )
    assert counts.tolist() == owned.sum(dim=1).tolist()
    for row in range(num_tokens):
        assert slots[row, : counts[row]].tolist() == expected[row][owned[row]].tolist(), f"row {row}"
        assert (slots[row, counts[row] :] == -1).all(), f"row {row}: no -1 after the prefix"

    positions = torch.arange(-1, 3 * TOP_K)
    to_req = torch.arange(positions.numel()) % 2
    written = slot_mapping(positions, to_req, block_table, rho=4, **layout)
    assert (
        written.tolist()
        == write_slot_mapping(positions, to_req, block_table, rho=4, bs=BS, S=INTERLEAVE, W=WORLD, r=RANK).tolist()
    )
    return slots, counts, written


class _OneRankOfTwo:
    """Rank 0 of a 2-rank group whose peer sent ``peer_lse`` and contributes
    nothing to the reduce-scatter: enough to run the ag_rs kernel in one
    process (the a2a one also needs its all-to-all stood in)."""

    world_size, rank_in_group, device_group = 2, 0, None

    def __init__(self, peer_lse: torch.Tensor):
        self.peer_lse = peer_lse

    def all_gather(self, x, dim):
        return torch.cat([x, self.peer_lse], dim=dim)

    def reduce_scatter(self, x, dim):
        return x.chunk(self.world_size, dim=dim)[self.rank_in_group]


def _stage3_partials():
    """-> (rank 0's out, the peer's out, both LSEs [2, T, H]): empty rows on
    either rank and on both, a NaN output under rank 0's empty LSE."""
    generator = torch.Generator().manual_seed(2)
    num_tokens, num_heads, head_dim = 9, 4, 48
    out, peer_out = torch.randn(2, num_tokens, num_heads, head_dim, generator=generator)
    lses = torch.randn(2, num_tokens, num_heads, generator=generator) * 4
    lses[0, 0] = -math.inf  # this rank empty (a NaN output under it must not leak)
    out[0] = math.nan
    lses[1, 1] = -math.inf  # the peer empty
    lses[:, 2] = -math.inf  # both empty
    return out, peer_out, lses


def _check_merged(merged, merged_lse, outs, lses) -> tuple[torch.Tensor, ...]:
    expected, expected_lse = merge_partials(torch.stack(outs), lses)
    own = slice(0, lses.shape[2] // 2)
    torch.testing.assert_close(merged.double(), expected[:, own], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged_lse.double(), expected_lse[:, own], rtol=1e-5, atol=1e-5)
    return merged, merged_lse


def check_stage3_ag_rs() -> tuple[torch.Tensor, ...]:
    out, _, lses = _stage3_partials()
    merged, merged_lse = combine(out, lses[0], _OneRankOfTwo(lses[1]), backend="ag_rs", return_lse=True)
    return _check_merged(merged, merged_lse, [out, torch.zeros_like(out)], lses)


def check_stage3_a2a() -> tuple[torch.Tensor, ...]:
    """The a2a kernel as rank 0 of 2: the all-to-all stood in by the peer's
    packed slice (its partial of rank 0's heads, its fp32 LSE as one more column)."""
    out, peer_out, lses = _stage3_partials()
    own = slice(0, lses.shape[2] // 2)
    peer_slice = torch.cat([peer_out[:, own], lses[1, :, own, None]], dim=-1)

    def all_to_all_single(received, send, group):
        received[0].copy_(send[0])
        received[1].copy_(peer_slice)

    with mock.patch.object(torch.distributed, "all_to_all_single", all_to_all_single):
        merged, merged_lse = combine(out, lses[0], _OneRankOfTwo(lses[1]), backend="a2a", return_lse=True)
    return _check_merged(merged, merged_lse, [out, peer_out], lses)


def check_stage9() -> tuple[torch.Tensor, ...]:
    seq_lens = torch.tensor([900, 500])
    rho = 2
    geometry = prefill_geometry(seq_lens, rho=rho, bs=BS, world_size=WORLD)
    oracle_geometry = gather_geometry(seq_lens, rho=rho, bs=BS, W=WORLD)
    topk = _topk(6, int(seq_lens.min()) // rho)
    token_to_req = torch.tensor([0, 0, 1, 1, 0, 1])
    is_valid = torch.tensor([True, False, True, True, True, True])
    slots, counts = prefill_remap(
        topk, token_to_req, is_valid, geometry, bs=BS, world_size=WORLD, interleave=INTERLEAVE
    )
    expected, expected_counts = remap_reference(
        topk, token_to_req, is_valid, oracle_geometry, bs=BS, S=INTERLEAVE, W=WORLD
    )
    assert slots.tolist() == expected.tolist()
    assert counts.tolist() == expected_counts.tolist()
    return slots, counts


# Each check asserts against the oracle and returns the kernels' outputs.
CHECKS = {
    "stage1": check_stage1,
    "stage3-ag_rs": check_stage3_ag_rs,
    "stage3-a2a": check_stage3_a2a,
    "stage9": check_stage9,
}


def run_checks() -> None:
    """Every check, one JSON line of {stage: traceback, or "" when it passed}."""
    failures = {}
    for stage, check in CHECKS.items():
        try:
            check()
            failures[stage] = ""
        except Exception:  # noqa: BLE001 - each stage's failure is reported by its own test
            failures[stage] = traceback.format_exc()
    print(json.dumps(failures))
