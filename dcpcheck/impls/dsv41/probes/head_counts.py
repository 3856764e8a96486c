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
# Each refusal must come when the layer is built (start-up), not at the first
# decode (SGLang #34355 / #39330 asserted head divisibility there, and GQA layouts
# corrupted silently). vLLM refuses a head count TP does not divide at start-up
# (config/model.py ModelConfig.verify_with_parallel_config, and the tree's
# DeepseekV4Attention.__init__ asserts it); its GQA bound on DCP (TP over the KV
# heads, same function) is skipped for MLA: DSV4.1 has one latent KV head, copied
# to every rank, so the gathered query heads are the only layout to refuse.
HEAD_COUNT_CASES = (
    (2, 8, None),
    (2, 64, None),  # DSV4.1's 128 heads at TP 2 and DCP 2
    (8, 16, None),  # DSV4.1's 128 heads at TP 8 and DCP 8
    (2, 4, "padded to 8 heads, so the gathered heads interleave padding with the ranks' heads"),
    (2, 12, "padded to 16 heads: the gathered heads interleave padding with the ranks' heads"),
    (4, 6, "padded to 8 heads, 24 gathered: padding between the ranks' heads, and a count no kernel takes"),
    (3, 8, "24 gathered heads, a count no sparse-MLA kernel takes"),
    (4, 64, "256 gathered heads, more than any sparse-MLA kernel takes (DSV4.1's 128 heads at TP 2 and DCP 4)"),
    (8, 32, "256 gathered heads at W 8, more than any sparse-MLA kernel takes"),
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
        except (NotImplementedError, ValueError, RuntimeError) as exc:  # RuntimeError: the SM120 config check
            if why_refused is None:
                problems.append(f"refuses W={world_size} with {local_heads} local heads, a served count: {exc}")
            continue
        if why_refused:
            problems.append(f"builds a layer at W={world_size} with {local_heads} local heads ({why_refused})")
    return "; ".join(problems) or None
