"""Stage 9: prefill on both sides of every length at which the port routes rows.

vllm#54300 (https://github.com/vllm-project/vllm/issues/54300): under DCP4,
prompts of 118 tokens were clean and prompts of 205 returned random tokens;
forcing the MQA path cured it. The bug sat where prefill is routed by length,
so a suite that only runs lengths far from every routing edge misses it.

The seed port routes a step's prefill rows (seed diff, ``_forward_prefill``
in ``vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py``):

* by the gather flag ``DSV41_DCP_PREFILL_GATHER`` (read once per process):
  the gathered path, else the stage-3 path;
* on the stage-3 path, in sub-chunks of ``DCP_PREFILL_TOKEN_CHUNK = 2048``
  rows (``range(qs, qe, self.DCP_PREFILL_TOKEN_CHUNK)``) inside each chunk
  of vLLM 0.33.0's ``PREFILL_CHUNK_SIZE = 4`` requests
  (``DeepseekV41SparseMLAAttention``, ``vllm/models/deepseek_v41/attention.py``).

The embedded port's stage-3 path splits the step's rows by its own
``DCP_PREFILL_TOKEN_CHUNK`` (``dcp_attention``); the dsv41 adapter hands the
chunk to the tree's layer (``server/layer.py``, ``build_port_layer``). Both
take it as ``build_attention(prefill_token_chunk=...)``, so a chunk of C
rows stands for 2048: here C is one row short of, equal to and one row past
each span the chunk loop walks (the step's rows; for an implementation that
declares ``prefill_chunk_size``, each request chunk's rows too), and half of
the step (two full sub-chunks). Every run, and the gathered path, must equal
DCP1. The decode threshold (vLLM's ``reorder_batch_threshold`` of 1,
``split_decodes_and_prefills``) is tests/e2e/test_decode_threshold.py's.
"""

from __future__ import annotations

import pytest

from dcpcheck.checks.prefill import oracle_dcp1, port_dcp1, prefill_step, run_layer
from dcpcheck.compare import assert_close, run_every_check
from dcpcheck.stages import STAGE_PREFILL

pytestmark = [
    pytest.mark.stage(STAGE_PREFILL),
    pytest.mark.needs("build_attention", "prefill_geometry", "prefill_gather", "prefill_remap"),
]


def routed_spans(ctx, step) -> list[int]:
    """The row counts a sub-chunk loop walks: the step's, and with a declared
    ``prefill_chunk_size`` each chunk of that many requests (rows in request order)."""
    token_to_req = step.batch.token_to_req
    spans = [int(token_to_req.numel())]
    requests_per_chunk = getattr(ctx.impl, "prefill_chunk_size", None)
    if requests_per_chunk:
        counts = token_to_req.bincount(minlength=step.batch.num_requests).tolist()
        spans += [sum(counts[i : i + requests_per_chunk]) for i in range(0, len(counts), requests_per_chunk)]
    return spans


def chunk_edges(spans: list[int]) -> list[int]:
    """Sub-chunk sizes one short of, equal to and one past every span, and half the step."""
    edges = {span + delta for span in spans for delta in (-1, 0, 1)} | {(spans[0] + 1) // 2}
    return sorted(edge for edge in edges if edge >= 1)


def check_routing_edges(ctx, *, rho, S, bs, K, backend):
    step = prefill_step(ctx, rho=rho, S=S, bs=bs, top_k=K, backend=backend)
    oracle_out = oracle_dcp1(step)
    w1_out = port_dcp1(ctx, step)
    kwargs = {"context": step.context, "row_labels": step.row_labels, "dtype": step.tolerance_dtype}
    routes = [
        (f"stage-3 path in sub-chunks of {chunk} rows", False, chunk) for chunk in chunk_edges(routed_spans(ctx, step))
    ]
    routes.append(("gathered path", True, None))

    def check_route(what, prefill_gather, chunk):
        layer = ctx.impl.build_attention(
            step.batch.layout,
            ctx.group,
            prefill_gather=prefill_gather,
            backend=backend,
            prefill_token_chunk=chunk,
            max_model_len=step.max_model_len,
        )
        out = run_layer(layer, step, ctx.device)
        what = f"{what} (step of {step.batch.num_tokens} rows)"
        assert_close(out, oracle_out, what=f"{what} vs float64 DCP1 oracle", **kwargs)
        assert_close(out, w1_out, what=f"{what} vs the implementation's W=1 path", **kwargs)

    run_every_check([(what, lambda what=what, g=g, c=c: check_route(what, g, c)) for what, g, c in routes])
    return {"routes": len(routes)}


@pytest.mark.world_sizes(1, 2, 4, 8)
def test_prefill_on_both_sides_of_every_routing_edge(dcp):
    """Ratio 1 on vLLM's 128-token page, interleave 2, a2a (the backend the tree serves)."""
    dcp.run(check_routing_edges, rho=1, S=2, bs=128, K=37, backend="a2a")
