"""The production profile (dcpcheck/scenarios/production.py) through the implementation's attention layer.

One served step per case: MTP decodes at the far end of requests past 2^17 tokens (the longest at
vLLM's served ``max_model_len``, its block-table rows as wide as vLLM's), and a chunked prefill's
chunk, at head dim 512 with vLLM's 584-byte fp8_ds_mla record (the real port), the heads per rank of
the TP x DCP layouts users serve on 2, 4 and 8 GPUs, top-k 512, 1024 and 2048, the compressed cache's
pages past 2^31 bytes of its KV pool. The cases run on CUDA, and on CPU with
``DCPCHECK_PROFILE=production``. ``test_production_logic_small`` runs everywhere: the same step at head
dim 64 and 8 heads a rank, top-k 2048, positions past 2^17 and a pool past 2^31 bytes.

Ratio 1 at every W; ratio 2 at W = 1 and 2. At W > 1 a ratio-2 layer of the seed port meets finding 1
(docs/dsv41.md): the case is its expected failure, and its run with the finding's cure checks the rest.
"""

from __future__ import annotations

import pytest

from dcpcheck.checks.production import check_production_step
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


def run_production(dcp, *, layout, top_k, prefill_gather, rho=1):
    require_production(dcp)
    dcp.run(
        check_production_step,
        profile=PRODUCTION.name,
        rho=rho,
        top_k=top_k,
        local_heads=layout.local_heads,
        prefill_gather=prefill_gather,
        interleave_tokens=rho,
    )


def layouts(world_size: int):
    return [pytest.param(layout, id=layout.name) for layout in SERVED_LAYOUTS[world_size]]


# (The folder's conftest.py runs its cases from W = 8 down.)
@SERVED_DCP8
@pytest.mark.world_sizes(8)
@pytest.mark.parametrize("prefill_gather", [GATHER])
@pytest.mark.parametrize("layout", layouts(8))
def test_production_dcp8(dcp, layout, prefill_gather):
    run_production(dcp, layout=layout, top_k=max(PRODUCTION.top_ks), prefill_gather=prefill_gather)


# W = 1: the DCP1 path, every served top-k; ratio 2 there too.
@SERVED
@pytest.mark.world_sizes(1)
@pytest.mark.stage(STAGE_COMBINE)
@pytest.mark.parametrize("rho, top_k", [(1, 512), (1, 1024), (1, 2048), (2, 2048)], ids=lambda v: str(v))
def test_production_dcp1(dcp, rho, top_k):
    run_production(dcp, layout=SERVED_LAYOUTS[1][0], top_k=top_k, prefill_gather=False, rho=rho)


# W = 2 (2 GPUs: TP2xDCP2, and DCP2 of 4 GPUs): every top-k on both prefill paths at TP2xDCP2.
@SERVED
@pytest.mark.world_sizes(2)
@pytest.mark.parametrize("prefill_gather", [GATHER, SUB_CHUNKS])
@pytest.mark.parametrize("top_k", PRODUCTION.top_ks, ids=lambda k: f"K{k}")
def test_production_dcp2(dcp, top_k, prefill_gather):
    run_production(dcp, layout=SERVED_LAYOUTS[2][0], top_k=top_k, prefill_gather=prefill_gather)


@SERVED
@pytest.mark.world_sizes(2)
@pytest.mark.parametrize("prefill_gather", [GATHER])
@pytest.mark.parametrize("layout", layouts(2)[1:])
def test_production_dcp2_of_tp4(dcp, layout, prefill_gather):
    run_production(dcp, layout=layout, top_k=max(PRODUCTION.top_ks), prefill_gather=prefill_gather)


# Ratio 2 at TP2xDCP2, an interleave of one state (2 tokens), on both prefill paths.
@SERVED
@DSV41_RATIO2
@pytest.mark.world_sizes(2)
@pytest.mark.parametrize("prefill_gather", [GATHER, SUB_CHUNKS])
def test_production_dcp2_ratio2(dcp, prefill_gather):
    run_production(dcp, layout=SERVED_LAYOUTS[2][0], top_k=max(PRODUCTION.top_ks), prefill_gather=prefill_gather, rho=2)


@SERVED_DCP4
@pytest.mark.world_sizes(4)
@pytest.mark.parametrize("prefill_gather", [GATHER, SUB_CHUNKS])
@pytest.mark.parametrize("layout", layouts(4))
def test_production_dcp4(dcp, layout, prefill_gather):
    run_production(dcp, layout=layout, top_k=max(PRODUCTION.top_ks), prefill_gather=prefill_gather)


# The profile's logic at a small head dim: W 1 and 2, top-k 2048, positions past 2^17, vLLM's rows at that
# max_model_len, the pool past 2^31 bytes (few pages touched); the gather at W = 2; ratios 1 and 2.
@pytest.mark.world_sizes(1, 2)
@pytest.mark.stage(STAGE_PREFILL)
@SMALL_RATIOS
def test_production_logic_small(dcp, rho):
    run_small(dcp, check_production_step, rho)
