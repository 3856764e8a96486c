"""Two consecutive served steps through the implementation's layer at the production profile, the second
reading what the first wrote (:mod:`dcpcheck.checks.production_trace`): a chunked prefill's chunk, an MTP
verification (q_len 1 + 4) and a decode past 2^17 tokens, then each request's next rows (the longest ending
at ``max_model_len`` 300,000), reading the newest states. Head dim 512, vLLM's 584-byte fp8_ds_mla record
(the real port), the served TP x DCP heads, top-k 2048, pages past 2^31 bytes of the KV pool. The cases run
on CUDA, and on CPU with ``DCPCHECK_PROFILE=production``; ``test_production_trace_small`` runs everywhere:
the same trace at head dim 64 and 8 heads a rank, positions past 2^17, top-k 2048.

Why not the e2e serving trace (tests/e2e): it writes every token from position 0 and draws every token's
query up front, which past 2^17 tokens is thousands of steps (docs/dsv41.md, the production profile).
Ratios 1 and 2 (at W > 1 a ratio-2 layer of the seed port meets finding 1: an expected failure, its cured
run checking the rest), as in test_production.py.
"""

from __future__ import annotations

import pytest

from dcpcheck.checks.production_trace import check_production_trace
from dcpcheck.scenarios.production import PRODUCTION, SERVED_LAYOUTS
from dcpcheck.stages import STAGE_COMBINE, STAGE_PREFILL
from tests.production.common import (
    DSV41_RATIO2,
    GATHER,
    SERVED,
    SERVED_DCP4,
    SERVED_DCP8,
    SMALL_RATIOS,
    SUB_CHUNKS,
    require_production,
    run_small,
)

pytestmark = pytest.mark.needs("build_attention")


def run_trace(dcp, *, rho=1, prefill_gather=True):
    require_production(dcp)
    dcp.run(
        check_production_trace,
        profile=PRODUCTION.name,
        rho=rho,
        top_k=max(PRODUCTION.top_ks),
        local_heads=SERVED_LAYOUTS[dcp.world_size][0].local_heads,
        prefill_gather=prefill_gather,
        interleave_tokens=rho,
    )


@SERVED
@pytest.mark.world_sizes(1)
@pytest.mark.stage(STAGE_COMBINE)
@pytest.mark.parametrize("rho", [1, 2], ids=lambda rho: f"rho{rho}")
def test_production_trace_dcp1(dcp, rho):
    run_trace(dcp, rho=rho, prefill_gather=False)


@SERVED
@pytest.mark.world_sizes(2)
@pytest.mark.parametrize("prefill_gather", [GATHER, SUB_CHUNKS])
def test_production_trace_dcp2(dcp, prefill_gather):
    run_trace(dcp, prefill_gather=prefill_gather)


@SERVED
@DSV41_RATIO2
@pytest.mark.world_sizes(2)
@pytest.mark.parametrize("prefill_gather", [GATHER])
def test_production_trace_dcp2_ratio2(dcp, prefill_gather):
    run_trace(dcp, rho=2, prefill_gather=prefill_gather)


@SERVED_DCP4
@pytest.mark.world_sizes(4)
@pytest.mark.parametrize("prefill_gather", [GATHER])
def test_production_trace_dcp4(dcp, prefill_gather):
    run_trace(dcp, prefill_gather=prefill_gather)


@SERVED_DCP8
@pytest.mark.world_sizes(8)
@pytest.mark.parametrize("prefill_gather", [GATHER])
def test_production_trace_dcp8(dcp, prefill_gather):
    run_trace(dcp, prefill_gather=prefill_gather)


# The trace's logic at a small head dim, on every host: W 1 and 2, the gather at W = 2, ratios 1 and 2.
@pytest.mark.world_sizes(1, 2)
@pytest.mark.stage(STAGE_PREFILL)
@SMALL_RATIOS
def test_production_trace_small(dcp, rho):
    run_small(dcp, check_production_trace, rho)
