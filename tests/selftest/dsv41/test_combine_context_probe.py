"""The spy behind ``--dcp-impl dsv41``'s combine-launch-context finding: what
``ctx`` two ``_run_sm120_dcp`` steps of one layer hand ``cp_lse_ag_out_rs``
(here positionally, as vLLM's signature allows), on stand-in layers (this
module is their module, as the tree's is the port's) that keep one context
across steps, make a new one each step, pass none, or never call it."""

from __future__ import annotations

import pytest
import torch

from dcpcheck.impls.dsv41.probes.combine_context import kept_combine_context
from dcpcheck.impls.dsv41.probes.common import PROBE_RATIO


class LaunchContext:
    pass


def _sm120_sparse_attention_with_lse(*args, **kwargs):
    raise AssertionError("the probe runs the step with its own kernel stand-in")


def cp_lse_ag_out_rs(out, lse, group, ctx=None, is_lse_base_on_e=True):
    raise AssertionError("the probe runs the step with its own combine spy")


class StandInLayer:
    """Its step calls the kernel and the combine as the port's ``_run_sm120_dcp`` does."""

    n_local_heads = 8
    head_dim = 64

    def __init__(self, context_per_step):
        self.context_per_step = context_per_step
        self._cp_ctx = LaunchContext()
        self.dcp_group = None
        self.attn_sink = None
        self._dcp_sink = None

    def _run_sm120_dcp(self, q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens, output):
        gathered = self.dcp_group.all_gather(q, dim=1)
        out, lse = torch.empty_like(gathered), torch.empty(gathered.shape[:2])
        _sm120_sparse_attention_with_lse(
            gathered, swa_cache, None, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens,
            out, 1.0, None, lse,
        )  # fmt: skip
        if self.context_per_step is None:  # a tree whose step combines by other means
            return
        output.copy_(cp_lse_ag_out_rs(out, lse, self.dcp_group, self.context_per_step(self), False))


@pytest.mark.parametrize(
    "context_per_step, kept",
    [
        (lambda layer: layer._cp_ctx, True),
        (lambda layer: LaunchContext(), False),
        (lambda layer: None, False),
        (None, False),
    ],
    ids=["one_context_per_layer", "a_new_context_each_step", "no_context", "no_ag_rs_combine"],
)
def test_the_context_kept_across_steps_is_found(context_per_step, kept):
    layer = StandInLayer(context_per_step)

    def build_layer(rank, rho, backend):
        assert (rank, rho, backend) == (0, PROBE_RATIO, "ag_rs")
        return layer

    found = kept_combine_context(build_layer)
    assert found is (layer._cp_ctx if kept else None)
