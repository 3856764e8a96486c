"""What the production tests share: their GPU memory needs, the prefill paths they run, the ratio-2 scenario and
the skip off CUDA (the profile itself: :mod:`dcpcheck.scenarios.production`)."""

from __future__ import annotations

import pytest

from dcpcheck.scenarios.production import PRODUCTION_CHOICE, PROFILE_ENV, SMALL_PRODUCTION, production_selected
from dcpcheck.stages import STAGE_COMBINE, STAGE_PREFILL

# One rank's GiB at its peak, from gpu_ci's per-case peaks on an H100 (the allocator's reserved peak of a case's
# ranks over their count) of the first case each rank process ran: 7.2 at W = 1 (top-k 512) and 6.0 at W = 2 (a
# rank holds 32 heads of a 300K-token request at D = 512, its 2 GiB KV pool and its cache), 6.8 at W = 4 and 6.1
# at W = 8. Later cases' peaks there (up to 27.3 GiB a rank) were the pools of the rank's earlier cases, which the
# dsv41 implementation kept (since freed with their case: server/step.py _mirror); top-k 2048 and ratio 2 take
# more than the first case's top-k 512, whence 12 at W <= 2. A case runs only where its need fits beside the
# running cases' (the GPU ledger, dcpcheck/ranks/gpu_ledger.py); 8 ranks of (7 + 1 GiB of context) would be over
# 85 % of an H100 and skip there.
SERVED = pytest.mark.gpu_memory(12)
SERVED_WIDE = pytest.mark.gpu_memory(7)
GATHER = pytest.param(True, marks=pytest.mark.stage(STAGE_PREFILL), id="gather")
SUB_CHUNKS = pytest.param(False, marks=pytest.mark.stage(STAGE_COMBINE), id="stage3_chunked")
# Ratio-2 layers: the seed port's finding 1 shows there at W > 1 (dcpcheck/impls/dsv41/findings/defects.py).
DSV41_RATIO2 = pytest.mark.scenario("dsv41_ratio2")
# The small profile's ratios: 1, and 2 (where the seed port meets finding 1 at W > 1).
SMALL_RATIOS = pytest.mark.parametrize("rho", [1, pytest.param(2, marks=DSV41_RATIO2)], ids=lambda rho: f"rho{rho}")


def require_production(dcp) -> None:
    if not production_selected(dcp.device_type):
        pytest.skip(f"the production profile runs on CUDA; on CPU set {PROFILE_ENV}={PRODUCTION_CHOICE}")


def run_small(dcp, check, rho: int) -> None:
    """``check`` at the small profile (head dim 64, 8 heads a rank, top-k 2048, positions past 2^17), the gather
    at W > 1, an interleave of one state."""
    dcp.run(
        check,
        profile=SMALL_PRODUCTION.name,
        rho=rho,
        top_k=max(SMALL_PRODUCTION.top_ks),
        local_heads=SMALL_PRODUCTION.heads_per_rank,
        prefill_gather=True,
        interleave_tokens=rho,
    )
