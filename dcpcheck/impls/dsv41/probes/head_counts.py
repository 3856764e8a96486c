"""Does the port's ``__init__`` refuse exactly the DCP head counts it cannot serve?"""

from __future__ import annotations

import types

import torch

from dcpcheck.impls.dsv41.probes.common import PROBE_PAGE_TOKENS, PROBE_RATIO, PROBE_TOKENS, probe_device
from dcpcheck.impls.dsv41.server.layer import LayerSpec, build_port_layer, index_topk
from dcpcheck.impls.dsv41.tree.loading import PortTree

# (W, local heads, why the port must refuse it under DCP, or None: a count it serves).
# The kernel sees the W ranks' local heads gathered [rank 0 | rank 1 | ...] and
# the combine's reduce-scatter hands each rank back its slice of that order.
HEAD_COUNT_CASES = (
    (2, 8, None),
    (2, 4, "padded to 8 heads, so the gathered heads interleave padding with the ranks' heads"),
    (3, 8, "24 gathered heads, a count no sparse-MLA kernel takes"),
    (4, 64, "256 gathered heads, more than any sparse-MLA kernel takes (DSV4.1's 128 heads at TP 2 and DCP 4)"),
)


def _head_count_layer(tree: PortTree, world_size: int, local_heads: int):
    device = probe_device()
    group = types.SimpleNamespace(world_size=world_size, rank_in_group=0, device=device)
    spec = LayerSpec(
        layer_id=0,
        rho=PROBE_RATIO,
        bs=PROBE_PAGE_TOKENS // PROBE_RATIO,
        interleave=1,
        world_size=world_size,
        rank=0,
        local_heads=local_heads,
        head_dim=64,
        window=128,
        sink=torch.zeros(local_heads),
        topk_buffer=torch.full((PROBE_TOKENS, index_topk()), -1, dtype=torch.int32, device=device),
        max_num_batched_tokens=PROBE_TOKENS,
        max_model_len=4096,
    )
    return build_port_layer(tree, group, spec, backend="a2a", prefill_token_chunk=None)


def head_count_finding(tree: PortTree) -> str | None:
    """Does the port's ``__init__`` refuse exactly the DCP head counts it cannot serve
    (:data:`HEAD_COUNT_CASES`)? None if it does."""
    problems = []
    for world_size, local_heads, why_refused in HEAD_COUNT_CASES:
        try:
            _head_count_layer(tree, world_size, local_heads)
        except (NotImplementedError, ValueError) as exc:
            if why_refused is None:
                problems.append(f"refuses W={world_size} with {local_heads} local heads, a served count: {exc}")
            continue
        if why_refused:
            problems.append(f"builds a layer at W={world_size} with {local_heads} local heads ({why_refused})")
    return "; ".join(problems) or None
