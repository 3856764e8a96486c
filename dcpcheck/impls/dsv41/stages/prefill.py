"""Stage 9's capabilities on the port's own ``_dcp_prefill_gather``.

The port fuses the geometry, the gather and the remap into one call per
layer, which keeps a step cache on its class (``_dcp_gather_cache``: the
step's metadata object, ``geom``, the gathered KV per source cache and the
remapped top-k per index buffer). Each capability is one such call, on a
fresh step cache, with its metadata object holding what the tree's reads
(``seq_lens``, ``block_table``), decode rows 0:

* ``prefill_geometry``: ``geom``, the pages and bases the call caches before
  its first collective; the call is stopped there. ``total_pages`` is the
  size of the buffer the port builds, ``W * sum(pages)`` (it keeps no total);
* ``prefill_gather``: the call with the given geometry in the step cache and
  no top-k row; its gathered cache ``[W*P, bs, 1, D]`` as ``[W*P*bs, D]``;
* ``prefill_remap``: the call with the given geometry and this cache's
  gathered KV already in the step cache (as a later layer of the step finds
  them), so only its remap runs; its slots and lens.

At W = 1 the port's forward never calls it (it takes the DCP1 path); the
stage-9 tests still call the helper there, its formulas at one rank.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

from dcpcheck.impls.dsv41.server.coordinator import layer_group
from dcpcheck.impls.dsv41.server.layer import NULL_PAGE
from dcpcheck.impls.dsv41.tree.loading import patched


@dataclass(frozen=True)
class PortGeometry:
    pages: torch.Tensor  # [R] int64
    bases: torch.Tensor  # [R] int64
    total_pages: int
    rho: int  # the compress ratio of the layer that computed it
    entry: tuple  # the port's own step-cache ``geom``: (pages list, pages, bases)


class _GeometryReached(Exception):
    """Raised by the first collective of ``_dcp_prefill_gather``: ``geom`` is cached by then."""


class _StopAtGather:
    def all_gather(self, tensor, dim=0):
        raise _GeometryReached


def _step_cache(metadata, geometry: PortGeometry | None = None, kv: dict | None = None) -> dict:
    return {"meta": metadata, "kv": kv or {}, "idx": {}, "geom": None if geometry is None else geometry.entry}


def _server_table(block_table: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """``block_table`` as wide as the gather reads (a vLLM row holds every page of a request on its
    rank, :func:`.serving.block_table_width`), spare columns on the null page, as the driver's tables."""
    width = max(block_table.shape[1], int(pages.max()) if pages.numel() else 0)
    table = torch.full((block_table.shape[0], width), NULL_PAGE, dtype=torch.int32, device=block_table.device)
    table[:, : block_table.shape[1]] = block_table
    return table


def _call(layer, group, cache, compressed, rows, num_requests: int, bs: int):
    """One ``_dcp_prefill_gather`` of ``num_requests`` prefill requests on the
    step cache ``cache`` (the class's, for this call only), ``group`` the layer's."""
    topk, token_to_req, is_valid_token = rows
    with patched(type(layer), _dcp_gather_cache=cache), patched(layer, dcp_group=layer_group(group)):
        return layer._dcp_prefill_gather(
            compressed, topk, token_to_req, is_valid_token.bool(), cache["meta"], 0, num_requests, bs
        )


def _no_rows(device):
    return (
        torch.empty((0, 1), dtype=torch.int32, device=device),
        torch.empty((0,), dtype=torch.int32, device=device),
        torch.empty((0,), dtype=torch.bool, device=device),
    )


def geometry(layer, seq_lens: torch.Tensor, *, rho: int, bs: int) -> PortGeometry:
    device = seq_lens.device
    num_requests = seq_lens.shape[0]
    table = torch.full((num_requests, 1), NULL_PAGE, dtype=torch.int32, device=device)
    cache = _step_cache(types.SimpleNamespace(seq_lens=seq_lens.to(torch.int32), block_table=table))
    one_page = torch.zeros((1, bs, 1), device=device)
    try:
        _call(layer, _StopAtGather(), cache, one_page, _no_rows(device), num_requests, bs)
    except _GeometryReached:
        pass
    if cache["geom"] is None:
        raise RuntimeError(f"{type(layer).__name__}._dcp_prefill_gather made no collective: no geometry to read")
    _, pages, bases = cache["geom"]
    return PortGeometry(pages, bases, layer.dcp_world_size * int(pages.sum()), rho, cache["geom"])


def gather(layer, comp_cache: torch.Tensor, block_table: torch.Tensor, geometry: PortGeometry, group, *, bs: int):
    head_dim = comp_cache.shape[-1]
    table = _server_table(block_table, geometry.pages)
    cache = _step_cache(types.SimpleNamespace(seq_lens=None, block_table=table), geometry)
    rows = _no_rows(comp_cache.device)
    kv, _, _ = _call(layer, group, cache, comp_cache.view(-1, bs, head_dim), rows, table.shape[0], bs)
    return kv.reshape(-1, head_dim)


def remap(layer, topk, token_to_req, is_valid_token, geometry: PortGeometry, *, bs: int):
    """The remap makes no collective: the layer runs it without a group."""
    compressed = torch.empty((1, bs, 1), device=topk.device)
    metadata = types.SimpleNamespace(seq_lens=None, block_table=None)
    cache = _step_cache(metadata, geometry, kv={compressed.data_ptr(): compressed})
    rows = (topk, token_to_req, is_valid_token)
    _, slots, lens = _call(layer, None, cache, compressed, rows, geometry.pages.shape[0], bs)
    return slots, lens
