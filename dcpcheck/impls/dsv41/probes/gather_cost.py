"""What the port's prefill-gather geometry costs across KV groups: host reads of
``attn_metadata.seq_lens`` in one gathered step (a measured cost, never a failure)."""

from __future__ import annotations

import types
from contextlib import nullcontext

import torch

from dcpcheck.impls.dsv41.probes.common import PROBE_TABLE_WIDTH, PROBE_WORLD_SIZE, LocalAllGather, probe_device
from dcpcheck.impls.dsv41.tree.loading import patched

# One gathered prefill step over layers of compress ratios 1, 2, 1 (three kv
# sources: two KV groups, so vLLM hands the layers two metadata objects, the
# first one twice), one 40-token prefill request on 8-state pages.
GEOMETRY_STACK = (1, 2, 1)
GEOMETRY_SEQ_LEN = 40
GEOMETRY_PAGE_STATES = 8
GEOMETRY_ROWS = 4


class _HostReadCounted(torch.Tensor):
    """A metadata tensor that counts the reads bringing its values to the host
    (each a device-to-host sync on CUDA); its slices count into the same total."""

    reads = 0
    HOST_READS = (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy)

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        if func in cls.HOST_READS:
            cls.reads += 1
        return super().__torch_function__(func, types_, args, kwargs or {})


def gather_geometry_reads(build_layer, topk_width: int) -> tuple[int, int]:
    """The cost of the port's prefill-gather geometry across KV groups:
    ``_dcp_prefill_gather`` of each layer of :data:`GEOMETRY_STACK` in one step,
    each layer given its KV group's metadata object, as vLLM's runner gives it.
    ``build_layer(rank, rho)``: a layer of the probe's layout; ``topk_width``: the top-k buffer's.
    -> (host reads of ``attn_metadata.seq_lens`` in the step, metadata objects)."""
    device = probe_device()
    metadata = {
        rho: types.SimpleNamespace(
            seq_lens=torch.tensor([GEOMETRY_SEQ_LEN], dtype=torch.int32, device=device).as_subclass(_HostReadCounted),
            block_table=torch.arange(1, PROBE_TABLE_WIDTH + 1, dtype=torch.int32, device=device).reshape(1, -1),
        )
        for rho in set(GEOMETRY_STACK)
    }
    topk = torch.full((GEOMETRY_ROWS, topk_width), -1, dtype=torch.int32, device=device)
    topk[:, 0] = 0
    cache = torch.zeros(PROBE_TABLE_WIDTH + 1, GEOMETRY_PAGE_STATES, 64, dtype=torch.bfloat16, device=device)
    layers = [build_layer(0, rho) for rho in GEOMETRY_STACK]
    # The port keeps its step cache on the class: a copy for the measurement, so real cases never see its entries.
    step_cache = getattr(type(layers[0]), "_dcp_gather_cache", None)
    keep_class_cache = (
        patched(type(layers[0]), _dcp_gather_cache=dict(step_cache)) if isinstance(step_cache, dict) else nullcontext()
    )
    _HostReadCounted.reads = 0
    with keep_class_cache:
        for rho, layer in zip(GEOMETRY_STACK, layers):
            _gather_once(layer, metadata[rho], cache, topk, device)
    return _HostReadCounted.reads, len(metadata)


def _gather_once(layer, metadata, cache, topk, device) -> None:
    with patched(layer, dcp_group=LocalAllGather(PROBE_WORLD_SIZE)):
        layer._dcp_prefill_gather(
            cache,
            topk,
            torch.zeros(GEOMETRY_ROWS, dtype=torch.int32, device=device),
            torch.ones(GEOMETRY_ROWS, dtype=torch.bool, device=device),
            metadata,
            0,
            1,
            GEOMETRY_PAGE_STATES,
        )
