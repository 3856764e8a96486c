"""One rank's model runner for the e2e tests: a stack of attention layers built
by the implementation, their caches, and the block tables of every KV layout
across a serving trace.

Each step it gives every request the pages its states need, builds the step
metadata once per KV layout (shared by every layer of that layout), then runs
each layer's forward, which writes the step's KV through the sharded write
path and attends. Caches start as NaN, so a read of a slot nobody wrote
poisons the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dcpcheck.checks.cases import checked_layer_output
from dcpcheck.oracle.layout import pages_needed
from dcpcheck.scenarios.layers import LayerLayout, LayerSpec, LayerStepInputs
from dcpcheck.scenarios.paging import PagedTables
from dcpcheck.scenarios.topology import StackPosition
from dcpcheck.scenarios.trace import RequestSpec, StepRows, swa_regions


@dataclass
class StackLayer:
    spec: LayerSpec
    layout: LayerLayout
    attention: object  # what the implementation's build_attention returned
    swa_cache: torch.Tensor  # [window buffer rows, D]
    comp_cache: torch.Tensor | None  # [pages * bs, D], this rank's compressed pages (rho >= 1)


class RankStack:
    def __init__(
        self,
        impl,
        group,
        specs: tuple[LayerSpec, ...],
        requests: list[RequestSpec],
        *,
        head_dim: int,
        window: int,
        heads: slice,
        seed: int,
        topology=None,
        **layer_options,
    ):
        """``topology``: the DSV4.1 topology ``specs`` were generated from
        (:meth:`dcpcheck.scenarios.topology.Dsv41Topology.layer_specs`); each
        layer is told its place in it."""
        world, rank, device = group.world_size, group.rank_in_group, group.device
        self.window, self.heads, self.device = window, heads, device
        self.swa_bases, swa_rows = swa_regions(requests)
        self.tables: dict[LayerLayout, PagedTables] = {}
        self.layers = []
        for spec in specs:
            layout = spec.layout(world)
            comp_cache = None
            if spec.kv_source is not None:
                source = self.layers[spec.kv_source]
                if source.layout != layout:
                    raise ValueError(
                        f"layer {len(self.layers)} reads layer {spec.kv_source}'s KV but has another layout"
                    )
                comp_cache = source.comp_cache
            elif spec.compressed:
                if layout not in self.tables:
                    # Every request's pages at once, the null page and a spare: freed pages still get reused first.
                    states = torch.tensor([request.final_len // spec.rho for request in requests])
                    num_pages = int(pages_needed(states, rank, spec.bs, spec.interleave, world).sum()) + 2
                    self.tables[layout] = PagedTables(layout.kv_layout(), rank, num_pages=num_pages, seed=seed)
                comp_cache = torch.full(
                    (self.tables[layout].num_pages * spec.bs, head_dim), float("nan"), device=device
                )
            stack = None if topology is None else StackPosition(len(self.layers), topology)
            attention = impl.build_attention(layout, group, stack=stack, **layer_options)
            swa_cache = torch.full((swa_rows, head_dim), float("nan"), device=device)
            self.layers.append(StackLayer(spec, layout, attention, swa_cache, comp_cache))

    def step(self, rows: StepRows, inputs: list[LayerStepInputs]) -> list[torch.Tensor]:
        """Every layer's output for this rank's heads: CPU [T, H_loc, D] each."""
        for tables in self.tables.values():
            for uid, length in zip(rows.uids, rows.seq_lens.tolist()):
                tables.grow(uid, length)
        swa_read, swa_write = rows.window_slots(self.window, self.swa_bases)
        device = self.device
        plans = {}
        outputs = []
        for layer, layer_inputs in zip(self.layers, inputs):
            if layer.layout not in plans:
                table = self.tables[layer.layout].table(rows.uids).to(device) if layer.spec.compressed else None
                plans[layer.layout] = layer.attention.plan_step(
                    seq_lens=rows.seq_lens.to(device),
                    token_to_req=rows.token_to_req.to(device),
                    positions=rows.positions.to(device),
                    is_valid_token=rows.is_valid_token.to(device),
                    is_prefill_request=rows.is_prefill_request.to(device),
                    swa_slots=swa_read.to(device),
                    swa_write_slots=swa_write.to(device),
                    block_table=table,
                )
            out = layer.attention.forward(
                plans[layer.layout],
                q=layer_inputs.q[:, self.heads].to(device),
                sink=layer_inputs.sink[self.heads].to(device),
                swa_cache=layer.swa_cache,
                comp_cache=layer.comp_cache,
                topk=None if layer_inputs.topk is None else layer_inputs.topk.to(device),
                kv=layer_inputs.kv.to(device),
                states=None if layer_inputs.states is None else layer_inputs.states.to(device),
            )
            outputs.append(checked_layer_output(out, layer_inputs.q[:, self.heads], device).cpu())
        return outputs

    def finish(self, uids) -> None:
        """Requests that left the batch give their pages back."""
        for tables in self.tables.values():
            for uid in uids:
                tables.release(uid)
