"""Stage 1 at the production profile (dcpcheck/scenarios/production.py): the ranks' filtered top-k partitions
the DCP1 set and each state is read where its one writer put it (:mod:`dcpcheck.checks.production_index`),
over one served step: MTP rows (q_len 1 + 4) and a decode at the far end of requests past 2^17 tokens (the
longest at ``max_model_len`` 300,000), a chunked prefill's 128-row chunk, top-k 512, 1024 and 2048, every
rank's block-table row as wide as vLLM's at that ``max_model_len``, vLLM's 128-token compressed page (64
states at ratio 2). Integer work: the profile's own values run on every host, in seconds a case.
"""

from __future__ import annotations

import pytest

from dcpcheck.checks.production_index import check_production_index
from dcpcheck.scenarios.production import PRODUCTION
from dcpcheck.stages import STAGE_INDEX
from tests.production.common import DSV41_RATIO2

pytestmark = [pytest.mark.stage(STAGE_INDEX), pytest.mark.needs("filter_index", "slot_mapping")]


# (rho, K, I): the production step's interleave (one state a rank in turn: I = rho tokens) at every served
# top-k; vllm#56715's 64 tokens and NIXL P/D's 128 (a whole page at ratio 1) at the widest top-k.
@pytest.mark.parametrize(
    "rho, top_k, interleave_tokens",
    [
        pytest.param(1, 512, 1, id="rho1-K512-I1"),
        pytest.param(1, 1024, 1, id="rho1-K1024-I1"),
        pytest.param(1, 2048, 1, id="rho1-K2048-I1"),
        pytest.param(2, 2048, 2, id="rho2-K2048-I2", marks=DSV41_RATIO2),
        pytest.param(1, 2048, 64, id="rho1-K2048-I64"),
        pytest.param(2, 2048, 64, id="rho2-K2048-I64", marks=DSV41_RATIO2),
        pytest.param(1, 2048, 128, id="rho1-K2048-I128"),
    ],
)
def test_production_index(dcp, rho, top_k, interleave_tokens):
    dcp.run(
        check_production_index,
        profile=PRODUCTION.name,
        rho=rho,
        top_k=top_k,
        interleave_tokens=interleave_tokens,
    )
