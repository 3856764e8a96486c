"""Do two DCP ranks launched with different combine / prefill-gather settings
issue the same collectives, or does the port refuse?

The seed port reads ``DSV41_DCP_COMBINE`` in its layer's ``__init__`` and
``DSV41_DCP_PREFILL_GATHER`` when its module is imported, each from its own
process's environment, and never asks its peers: a per-rank backend decision
without agreement (vllm #48248's review of a fused-a2a workspace that fell back
to NCCL per rank). Ranks that decide differently enter different collectives:
on NCCL a hang, or buffers of one shape reduced as another.

This probe runs in one process: it builds rank 0's layer under one setting and
rank 1's under the other, runs one prefill step of each (a ratio-2 layer, its
kernels stand-ins) over a group that records every collective the step issues,
and compares the two sequences. The combine and the gather are recorded where
the port calls them, each with the collectives vLLM's function (or the port's
helper) issues inside, so no collective is ever entered with a peer.
"""

from __future__ import annotations

import types

import torch

from dcpcheck.impls.dsv41.probes.common import (
    PROBE_PAGE_TOKENS,
    PROBE_RATIO,
    PROBE_TOKENS,
    PROBE_WORLD_SIZE,
    probe_device,
)
from dcpcheck.impls.dsv41.server.layer import COMBINE_ENV, PREFILL_GATHER_ENV, LayerSpec, build_port_layer, index_topk
from dcpcheck.impls.dsv41.tree.loading import DCP1_KERNEL, SM120_WRAPPER, PortTree, cuda_query_stand_ins, patched

# What each collective-issuing call the step makes enters, on the DCP group.
COMBINE_COLLECTIVES = {
    # v1/attention/ops/dcp.py cp_lse_ag_out_rs: _cp_lse_common all-gathers the LSEs, then reduce_scatter.
    "cp_lse_ag_out_rs": ("all_gather(lse)", "reduce_scatter(out, dim=1)"),
    # v1/attention/ops/dcp.py dcp_a2a_lse_reduce: one all_to_all_single on cp_group.device_group.
    "dcp_a2a_lse_reduce": ("all_to_all_single(out|lse)",),
}
# The port's _dcp_prefill_gather: the compressed KV pages all-gathered over the DCP group.
GATHER_COLLECTIVES = ("all_gather(compressed kv pages)",)

# (rank 0's settings, rank 1's settings): each variable alone differs.
DISAGREEMENTS = (
    ({COMBINE_ENV: "ag_rs", PREFILL_GATHER_ENV: "0"}, {COMBINE_ENV: "a2a", PREFILL_GATHER_ENV: "0"}),
    ({COMBINE_ENV: "ag_rs", PREFILL_GATHER_ENV: "0"}, {COMBINE_ENV: "ag_rs", PREFILL_GATHER_ENV: "1"}),
)


class RecordingGroup:
    """A DCP group of one process that records each collective issued on it; its
    all-gather stacks W copies of this rank's part (the probe needs shapes, not values)."""

    def __init__(self, world_size: int, rank: int, device):
        self.world_size, self.rank_in_group, self.device = world_size, rank, device
        self.issued: list[str] = []

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        self.issued.append(f"all_gather({tuple(tensor.shape)}, dim={dim})")
        return torch.cat([tensor] * self.world_size, dim=dim)


def _layer(tree: PortTree, rank: int, environ: dict[str, str]):
    device = probe_device()
    group = types.SimpleNamespace(world_size=PROBE_WORLD_SIZE, rank_in_group=rank, device=device)
    spec = LayerSpec(
        layer_id=0,
        rho=PROBE_RATIO,
        bs=PROBE_PAGE_TOKENS // PROBE_RATIO,
        interleave=1,
        world_size=PROBE_WORLD_SIZE,
        rank=rank,
        local_heads=8,
        head_dim=64,
        window=128,
        sink=torch.zeros(8),
        topk_buffer=torch.full((PROBE_TOKENS, index_topk()), -1, dtype=torch.int32, device=device),
        max_num_batched_tokens=PROBE_TOKENS,
        max_model_len=4096,
    )
    return build_port_layer(
        tree,
        group,
        spec,
        backend=environ[COMBINE_ENV],
        prefill_token_chunk=None,
        prefill_gather=environ[PREFILL_GATHER_ENV] == "1",
    )


def step_collectives(layer, module, rank: int) -> list[str]:
    """The collectives, in order, that one prefill step of ``layer`` (rank ``rank``'s, of the
    port ``module``) issues on its DCP group (one request of PROBE_TOKENS tokens)."""
    device = probe_device()
    group = RecordingGroup(PROBE_WORLD_SIZE, rank, device)
    tokens, heads, dim = PROBE_TOKENS, layer.n_local_heads, layer.head_dim
    rows = torch.zeros((tokens, 1, 1), dtype=torch.int32, device=device)
    lens = torch.zeros(tokens, dtype=torch.int32, device=device)

    def recorded(name, collectives, result):
        def call(*args, **kwargs):
            group.issued.extend(f"{name}: {collective}" for collective in collectives)
            return result(*args, **kwargs)

        return call

    def combined(out, *args, **kwargs):
        return out[:, : out.shape[1] // PROBE_WORLD_SIZE]

    def no_kernel(*args, **kwargs):
        return None

    swa_metadata = types.SimpleNamespace(
        num_prefills=1,
        num_decodes=0,
        num_decode_tokens=0,
        num_prefill_tokens=tokens,
        query_start_loc_cpu=torch.tensor([0, tokens]),
        token_to_req_indices=torch.zeros(tokens, dtype=torch.int32, device=device),
        is_valid_token=torch.ones(tokens, dtype=torch.bool, device=device),
        prefill_swa_indices=rows,
        prefill_swa_lens=lens,
    )
    attn_metadata = types.SimpleNamespace(block_size=PROBE_PAGE_TOKENS, block_table=None)
    cache = torch.zeros((1, 1, dim), dtype=torch.bfloat16, device=device)
    q = torch.zeros((tokens, heads, dim), dtype=torch.bfloat16, device=device)
    with (
        cuda_query_stand_ins(),
        patched(
            module,
            **{SM120_WRAPPER: no_kernel, DCP1_KERNEL: no_kernel},
            **{
                name: recorded(name, collectives, combined)
                for name, collectives in COMBINE_COLLECTIVES.items()
                if hasattr(module, name)
            },
        ),
        patched(
            layer,
            dcp_group=group,
            _dcp_sink=None,
            _prepare_query=lambda q, output: q,
            _as_sparse_cache=lambda kv: kv,
            _compressed_topk_to_slots=lambda *args, **kwargs: (rows, lens),
            _dcp_prefill_gather=recorded(
                "_dcp_prefill_gather", GATHER_COLLECTIVES, lambda *args, **kwargs: (cache, rows, lens)
            ),
        ),
    ):
        layer._forward_prefill(q, cache, cache, torch.empty_like(q), attn_metadata, swa_metadata)
    return group.issued


def _settings(environ: dict[str, str]) -> str:
    return ", ".join(f"{name}={value}" for name, value in environ.items())


def backend_agreement_finding(tree: PortTree) -> str | None:
    """Do ranks launched with different :data:`DISAGREEMENTS` issue the same collectives in a
    step (or does a rank refuse to build)? None if every pair agrees or is refused."""
    problems = []
    for settings in DISAGREEMENTS:
        try:
            layers = [_layer(tree, rank, environ) for rank, environ in enumerate(settings)]
        except (NotImplementedError, ValueError):
            continue  # the port refuses the disagreement when a layer is built: what it must do
        issued = [step_collectives(layer, module, rank) for rank, (layer, module) in enumerate(layers)]
        if issued[0] == issued[1]:
            continue
        first = next((i for i, (a, b) in enumerate(zip(*issued)) if a != b), min(len(issued[0]), len(issued[1])))
        said = [seq[first] if first < len(seq) else "nothing (its step has ended)" for seq in issued]
        problems.append(
            f"rank 0 launched with {_settings(settings[0])} and rank 1 with {_settings(settings[1])} both build "
            f"and serve, and their prefill steps part at collective {first + 1}: rank 0 enters {said[0]}, rank 1 "
            f"{said[1]} ({len(issued[0])} vs {len(issued[1])} collectives; on NCCL a hang or a mismatch)"
        )
    if not problems:
        return None
    return (
        "the port decides its DCP backends per rank from each process's environment (DSV41_DCP_COMBINE in the "
        "layer's __init__, DSV41_DCP_PREFILL_GATHER at import) and never agrees on them with its peers: "
        + "; ".join(problems)
    )
