"""What the GPU tests share: the shape profile they run at, oracle spot rows,
and the stats every rank function returns for the CI summary (the check that
every rank drew the same inputs: :mod:`dcpcheck.checks.same_inputs`)."""

from __future__ import annotations

import torch

from dcpcheck.compare import CloseStats
from dcpcheck.oracle import attention as oracle
from dcpcheck.plugin.session import seed_for_test
from dcpcheck.scenarios.batch import StepBatch
from dcpcheck.scenarios.profiles import profile_for


def profile_name(dcp, model: str) -> str:
    """The case parameter naming the profile of DeepSeek ``model`` ("v4.0",
    "v4.1") a test runs at on this device (a name: failure messages and the
    task sent to the ranks stay small)."""
    return profile_for(dcp.device_type, model).name


def shared_seed(dcp, scenario: str) -> int:
    """One seed for every case of ``scenario`` (e.g. the two backends of one
    rho), so that a rank process builds that scenario once and reuses it;
    still varied by --dcp-seed."""
    return seed_for_test(dcp.session, f"tests/gpu::{scenario}")


def spot_rows(batch: StepBatch, stride: int) -> torch.Tensor:
    """Rows the float64 oracle checks: the first and last row of every
    (request, role, top-k pattern) run, so every edge case is in, plus every
    ``stride``-th row. The implementation's own DCP1 path checks all rows."""
    keys = list(zip(batch.token_to_req.tolist(), batch.row_roles, batch.topk_patterns))
    chosen = set(range(0, len(keys), stride))
    for t, key in enumerate(keys):
        if t == 0 or keys[t - 1] != key:
            chosen.add(t)
        if t == len(keys) - 1 or keys[t + 1] != key:
            chosen.add(t)
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def oracle_spot_check(q, comp_cache, comp_slots, swa_cache, swa_slots, sink, *, scale: float, rows: torch.Tensor):
    """Float64 DCP1 attention of ``rows`` only -> (out [len(rows), H, D], lse)."""
    comp = oracle.compact_candidates(comp_cache, comp_slots[rows])
    swa = oracle.compact_candidates(swa_cache, swa_slots[rows])
    return oracle.sparse_attention(q[rows], *comp, *swa, sink, scale=scale)


def summary(stats: dict[str, CloseStats]) -> dict:
    """What a rank function returns: the worst comparison, for the CI table."""
    worst_check = max(stats, key=lambda what: stats[what].worst_ratio)
    return {
        "worst_ratio": stats[worst_check].worst_ratio,
        "max_abs_err": max(s.max_abs_err for s in stats.values()),
        "worst_check": worst_check,
    }
