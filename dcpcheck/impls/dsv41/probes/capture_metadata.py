"""Does the tree's DSV4.1 metadata builder give a captured CUDA graph the same DCP-local
metadata as the real step?

The GB10 TP2+DCP2 bring-up (tpurtell/ds4fv-vllm-28-sm12x) found three setup paths that
omitted the DCP-local lengths: the proposer's inputs, the eager/profile dummy run and the
graph-capture metadata builder. In vLLM 0.33.0 the runner's dummy batch
(``v1/worker/gpu_model_runner.py`` ``_dummy_run``, the profile run's too) goes through the
real step's ``_build_attention_metadata``: the DCP-local lengths from
``get_dcp_local_seq_lens`` and the token slots from ``BlockTable.compute_slot_mapping``
(``v1/worker/cp_utils.py`` ``prepare_dcp_dummy_context_metadata`` gives the dummy requests
``W * interleave`` tokens of context first); only the builder's call differs while a
graph is captured: ``build_for_cudagraph_capture``, which the DSV4.1 builders inherit from
``AttentionMetadataBuilder`` (``v1/attention/backend.py``) or override. So the probe asks the
tree's own builder, on each rank, for the metadata of one request through ``build`` and
through ``build_for_cudagraph_capture``, from the same rank-local inputs (vLLM's DCP token
slots of that rank), and compares every tensor and number of the two.
"""

from __future__ import annotations

import torch

from dcpcheck.impls.dsv41.probes.common import (
    PROBE_INTERLEAVE_TOKENS,
    PROBE_RATIO,
    PROBE_WORLD_SIZE,
)
from dcpcheck.impls.dsv41.probes.writer import probe_metadata
from dcpcheck.impls.dsv41.tree.loading import BUILDER_CLASS, PortTree


def _fields(metadata) -> dict:
    """The metadata's tensors and numbers by name (what a captured graph reads)."""
    return {
        name: value
        for name, value in vars(metadata).items()
        if isinstance(value, torch.Tensor | int | float | bool) or value is None
    }


def _differs(step, captured) -> bool:
    if isinstance(step, torch.Tensor) and isinstance(captured, torch.Tensor):
        return step.shape != captured.shape or not torch.equal(step, captured)
    return step != captured


def capture_metadata_finding(tree: PortTree, vllm) -> str | None:
    """Does the tree's builder give ``build_for_cudagraph_capture`` the real step's metadata on
    every rank? None if it does."""
    problems = []
    for rank in range(PROBE_WORLD_SIZE):
        step = _fields(probe_metadata(tree, vllm, rank, for_cudagraph_capture=False))
        captured = _fields(probe_metadata(tree, vllm, rank, for_cudagraph_capture=True))
        differing = sorted(
            name for name in step.keys() | captured.keys() if _differs(step.get(name), captured.get(name))
        )
        if differing:
            problems.append(f"rank {rank}: {', '.join(differing)}")
    if not problems:
        return None
    builder = getattr(tree.module({}), BUILDER_CLASS)
    return (
        f"{builder.__qualname__}.build_for_cudagraph_capture builds other metadata than its build for the same "
        f"rank-local step (W={PROBE_WORLD_SIZE}, compress ratio {PROBE_RATIO}, a {PROBE_INTERLEAVE_TOKENS}-token "
        f"interleave), so a captured graph replays another placement than the eager step: " + "; ".join(problems)
    )
