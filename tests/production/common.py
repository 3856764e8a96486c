"""What the production tests share: their GPU memory needs, the prefill paths they run, the ratio-2 scenario and
the skip off CUDA (the profile itself: :mod:`dcpcheck.scenarios.production`)."""

from __future__ import annotations

import pytest

from dcpcheck.scenarios.production import PRODUCTION_CHOICE, PROFILE_ENV, SMALL_PRODUCTION, production_selected
from dcpcheck.stages import STAGE_COMBINE, STAGE_PREFILL

# One rank's GiB at its peak, from gpu_ci's per-case peaks (the allocator's reserved peak of a case's ranks over
# their count) on an H100 at 1b1ce93, every case of each W: at most 8.7 at W = 1, 7.7 at W = 2 (a rank holds 32
# heads of a 300K-token request at D = 512, its 2 GiB KV pool and its cache), 7.5 at W = 4 and 6.6 at W = 8; with
# some margin, but at W = 8 at most what 85 % of an H100 holds beside 8 CUDA contexts (more skips there). A case
# runs only where its need fits beside the running cases' (the GPU ledger, dcpcheck/ranks/gpu_ledger.py, which
# also keeps other processes from starting ranks while a case holds most of the GPU).
SERVED = pytest.mark.gpu_memory(10)
SERVED_DCP4 = pytest.mark.gpu_memory(8.5)
SERVED_DCP8 = pytest.mark.gpu_memory(7)
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
