"""Does the tree's compressed write side (its DSV4.1 metadata builder) place states where
vLLM's DCP writer (``get_compressed_slot_mapping`` called with ``dcp_world_size`` and
``cp_interleave``, as vLLM's indexer calls it) does?"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

from dcpcheck.impls.dsv41.probes.common import (
    PROBE_INTERLEAVE_TOKENS,
    PROBE_PAGE_TOKENS,
    PROBE_RATIO,
    PROBE_TOKENS,
    PROBE_WORLD_SIZE,
    probe_request,
)
from dcpcheck.impls.dsv41.server.metadata import build_compressed_metadata
from dcpcheck.impls.dsv41.tree.loading import BUILDER_CLASS, PortTree, patched


@contextmanager
def _recording_writer_calls(tree: PortTree):
    """The keyword arguments of every ``get_compressed_slot_mapping`` call the builder makes."""
    builder_cls = getattr(tree.module({}), BUILDER_CLASS)
    build_module = sys.modules[builder_cls.build.__module__]
    writer = getattr(build_module, "get_compressed_slot_mapping", None)
    calls: list[dict] = []
    if writer is None:
        yield calls
        return

    def recorded(*args, **kwargs):
        calls.append(kwargs)
        return writer(*args, **kwargs)

    with patched(build_module, get_compressed_slot_mapping=recorded):
        yield calls


def dcp_writer_slots(vllm, rank: int) -> torch.Tensor:
    """vLLM's DCP placement of the probe's states on ``rank``: [PROBE_TOKENS] slots, -1 where no state."""
    positions, token_to_req, block_table = probe_request(rank)
    return vllm.slot_mapping(
        positions,
        token_to_req,
        block_table,
        rho=PROBE_RATIO,
        bs=PROBE_PAGE_TOKENS // PROBE_RATIO,
        world_size=PROBE_WORLD_SIZE,
        rank=rank,
        interleave=PROBE_INTERLEAVE_TOKENS // PROBE_RATIO,
    )


def probe_metadata(tree: PortTree, vllm, rank: int, *, for_cudagraph_capture: bool = False):
    """The tree's builder's metadata of the probe's request on ``rank``, from vLLM's DCP token slots of that
    rank (through ``build_for_cudagraph_capture`` where asked)."""
    positions, token_to_req, block_table = probe_request(rank)
    token_slots = vllm.token_slots(
        positions,
        token_to_req,
        block_table,
        tokens_per_page=PROBE_PAGE_TOKENS,
        world_size=PROBE_WORLD_SIZE,
        rank=rank,
        token_interleave=PROBE_INTERLEAVE_TOKENS,
    )
    return build_compressed_metadata(
        tree,
        rho=PROBE_RATIO,
        tokens_per_page=PROBE_PAGE_TOKENS,
        token_slots=token_slots,
        query_start_loc=torch.tensor([0, PROBE_TOKENS], dtype=torch.int32, device=positions.device),
        seq_lens=torch.tensor([PROBE_TOKENS], dtype=torch.int32, device=positions.device),
        block_table=block_table.clone(),
        token_to_req=token_to_req,
        num_actual_tokens=PROBE_TOKENS,
        topk_tokens=0,
        for_cudagraph_capture=for_cudagraph_capture,
    )


def writer_finding(tree: PortTree, vllm) -> str | None:
    """Does the tree's builder place compressed states where vLLM's DCP writer does? None if it does."""
    wrong = 0
    written = 0
    with _recording_writer_calls(tree) as calls:
        for rank in range(PROBE_WORLD_SIZE):
            expected = dcp_writer_slots(vllm, rank)
            metadata = probe_metadata(tree, vllm, rank)
            actual = metadata.slot_mapping[:PROBE_TOKENS]
            wrong += int((actual != expected).sum())
            written += int((expected >= 0).sum())
    if not wrong:
        return None
    build = getattr(tree.module({}), BUILDER_CLASS).build
    where = f"{build.__module__.replace('.', '/')}.py:{build.__qualname__}"
    if calls and not any("dcp_world_size" in call for call in calls):
        how = "passes no dcp_world_size to get_compressed_slot_mapping"
    else:
        how = "places compressed states elsewhere than vLLM's DCP writer"
    return (
        f"the write side of the DCP2 port is missing: {where} {how} (W={PROBE_WORLD_SIZE}, compress ratio "
        f"{PROBE_RATIO}, a {PROBE_INTERLEAVE_TOKENS}-token interleave: {wrong} of {PROBE_TOKENS * PROBE_WORLD_SIZE} "
        f"token rows get another slot; vLLM's DCP writer writes {written} states)"
    )
