"""``--dcp-impl dsv41[:MODULE:CLASS]``: the DCP2 port of a vLLM tree's DeepSeek-V4.1
FlashInfer sparse-MLA attention, checked through its real class.

Capabilities:

* ``filter_index`` — the layer's ``_compressed_topk_to_slots`` on a layer of
  that rank (W = 1: the tree's ``compute_global_topk_indices_and_lens``);
* ``slot_mapping`` — the tree's own vLLM function, as the port's write side calls it;
* ``combine`` — where the port can be given the case (bf16 partials, base-2
  LSEs, ``return_lse=False``, W > 1, H = 8·W) the layer's own
  ``_run_sm120_dcp``, its kernel standing in by writing the given partials
  (:mod:`dcpcheck.impls.dsv41.stages.combine`); elsewhere the tree's vLLM combine, as
  that step calls it (base-2 LSEs only: the port never passes another base),
  whose known defects there are off the port's path (:mod:`.defects`);
* ``fused_combine`` — that same ``_run_sm120_dcp`` call, with what it handed
  its kernel: the sink (``_dcp_attn_sink``) and the window rows
  (``_dcp_neutral_swa`` on ranks other than 0);
* ``prefill_geometry``, ``prefill_gather``, ``prefill_remap`` — the layer's
  ``_dcp_prefill_gather``, one call each on a fresh step cache, its geometry,
  gathered cache and remapped top-k read out (:mod:`dcpcheck.impls.dsv41.stages.prefill`);
  the layer's forward makes that call itself (``fused_prefill``);
* ``build_attention`` — the stage gate of the tree's metadata builder, then a
  layer entered through its real ``forward_mqa``
  (:mod:`dcpcheck.impls.dsv41.server.step`).

The port fuses its stage-3 steps into ``_run_sm120_dcp``, so
``gather_heads``, ``sparse_attention``, ``partial_attention`` and
``dcp_attention`` are absent and checked through the layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch

from dcpcheck.impls.conventions import Conventions
from dcpcheck.impls.dsv41.findings import stand_ins
from dcpcheck.impls.dsv41.findings.cures import check_cures, cured_layer
from dcpcheck.impls.dsv41.findings.defects import inherited_defect, port_defect
from dcpcheck.impls.dsv41.kernels import reference as reference_kernel
from dcpcheck.impls.dsv41.probes import common as probe
from dcpcheck.impls.dsv41.probes.refusal import indexer_dcp_refusal
from dcpcheck.impls.dsv41.probes.serving import ServingFindings
from dcpcheck.impls.dsv41.server.kv_cache_format import FP8_DS_MLA
from dcpcheck.impls.dsv41.server.layer import (
    TOPK_TILE,
    LayerSpec,
    build_port_layer,
    check_stage_gate,
    index_topk,
    tree_refusal,
)
from dcpcheck.impls.dsv41.server.step import PortAttention
from dcpcheck.impls.dsv41.stages import prefill
from dcpcheck.impls.dsv41.stages.combine import in_port_domain, run_step
from dcpcheck.impls.dsv41.tree import sources
from dcpcheck.impls.dsv41.tree.loading import PortSpec, PortSpecError, PortTree
from dcpcheck.impls.protocol import KnownFailure

__all__ = ["Dsv41Implementation", "PortSpecError"]

MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_MAX_MODEL_LEN = 4096


class Dsv41Implementation:
    name = "dsv41"
    conventions = Conventions(
        topk_multiple=TOPK_TILE,
        layer_dtype=torch.bfloat16,
        empty_lse=reference_kernel.EMPTY_LSE,
        local_heads=8,
        lse_bases=(2.0,),
        sink_scheme="rank0",  # _dcp_attn_sink: the gathered sink goes to the kernel on DCP rank 0 only
        filter_takes_ratio=True,  # the layer's cp_kv_cache_interleave_size is in tokens: interleave * rho
        fused_prefill=True,  # _forward_prefill calls _dcp_prefill_gather, not the prefill capabilities
        kv_cache_format=FP8_DS_MLA,  # the layer's default kv_cache_dtype; None in the bf16 variant
    )
    max_num_batched_tokens = MAX_NUM_BATCHED_TOKENS
    # build_attention's options of the production profile (dcpcheck/scenarios/production.py)
    SERVED_OPTIONS = ("index_topk", "kv_pool_offset")

    def __init__(self, spec: str = "dsv41"):
        from dcpcheck.impls.vllm_adapter import VllmImplementation

        self.vllm = VllmImplementation()  # sets up triton for vLLM on CPU; the tree's own functions
        self.tree = PortTree(PortSpec.parse(spec))
        self.kv_cache_dtype = self.tree.spec.kv_cache_dtype
        if self.kv_cache_dtype != FP8_DS_MLA:  # dcpcheck's bf16 variant: plain rows, rounded as layer_dtype
            self.conventions = dataclasses.replace(self.conventions, kv_cache_format=None)
        index_topk()  # read from the tree's indexer now: a tree without it is a usage error at start
        self._port_layers: dict[tuple, object] = {}
        self._topk_buffers: dict[torch.device, torch.Tensor] = {}
        self._layers_built = 0
        self._ratio_refusals: dict[int, str | None] = {}
        self.findings = ServingFindings(
            self.tree,
            self.vllm,
            lambda rank, rho, backend="a2a": self._port_layer(
                probe.probe_device(),
                probe.PROBE_WORLD_SIZE,
                rank,
                probe.PROBE_INTERLEAVE_TOKENS // rho,
                rho=rho,
                backend=backend,
            ),
        )
        # id(suite cache) -> (a weak reference to it, its copy in kv_cache_dtype at a fixed address), while it lives
        self.cache_mirrors: dict[int, tuple] = {}
        self.cures: tuple[str, ...] = ()  # the findings neutralised in this run of a case (cures.py)

    @contextlib.contextmanager
    def cured(self, cures):
        """Calls into the port's layers with the findings named by ``cures`` neutralised (:mod:`.cures`)."""
        self.cures = check_cures(tuple(cures))
        try:
            yield
        finally:
            self.cures = ()

    def calling(self, layer):
        """A context manager for one call into ``layer``: the case's cures applied to it."""
        return cured_layer(layer, self.cures)

    def describe(self) -> str:
        tree = f"tree: {self.tree.spec.module}.{self.tree.spec.cls}"
        writer = (
            "the tree's metadata builder"
            if self.findings.compressed_writer is None
            else "vLLM's DCP writer stands in (the tree's places no state by DCP: finding 4)"
        )
        swa = (
            "as the tree's spec"
            if self.findings.swa_placement is None
            else "replicated, as the port reads it (the tree's spec shards it: finding 5)"
        )
        first = " | ".join(
            (
                tree,
                f"kernel: {self.tree.kernel}",
                f"compressed write side: {writer}",
                f"SWA cache: {swa}",
                f"prefill gather geometry: {self.findings.gather_geometry_cost}",
                f"SM120 kernel envelope of the served shapes: {self.findings.kernel_envelope_summary}",
                *self.vllm.stand_ins,
            )
        )
        served = (
            f"served as: KV cache format {self._cache_format()} | SWA pages of {sources.swa_block_size()} tokens | "
            f"top-k width {index_topk()} (vLLM serves {', '.join(map(str, sources.served_topk_widths()))} under DCP) | FlashInfer {self.tree.flashinfer.sources.version}'s SM120 entry signature"
        )
        return "\n".join([first, served, *stand_ins.header_lines(self)])

    def _cache_format(self) -> str:
        if self.kv_cache_dtype == FP8_DS_MLA:
            return "fp8_ds_mla, vLLM's default (its record scaled to the case's head dim: stand-in below)"
        return f"{self.kv_cache_dtype} (dcpcheck's variant, --dcp-impl ...@{self.kv_cache_dtype}; vLLM's default is fp8_ds_mla)"

    @property
    def prefill_chunk_size(self) -> int:
        """Prefill requests the forward attends per chunk: the tree's ``PREFILL_CHUNK_SIZE``."""
        return getattr(self.tree.module({}), self.tree.spec.cls).PREFILL_CHUNK_SIZE

    def serving_probes(self) -> dict[str, str | None]:
        """What the tree's own code says of how it serves the port (:mod:`.serving`): name -> finding or None."""
        return self.findings.by_name()

    def dcp_refusal(self, topology, interleave_tokens: int, world_size: int) -> str | None:
        """Why the tree's indexer refuses to serve ``topology`` under DCP ``world_size`` with an
        interleave of ``interleave_tokens`` (asked of its metadata builder, per index-source ratio, at every W:
        a server without DCP builds it too), or None."""
        ratios = sorted({topology.compress_ratios[source] for source in topology.index_source_layer_ids})
        for ratio in ratios:
            refusal = indexer_dcp_refusal(
                self.tree, ratio=ratio, interleave_tokens=interleave_tokens, world_size=world_size
            )
            if refusal:
                return refusal
        return None

    def topk_buffer(self, device, width: int | None = None) -> torch.Tensor:
        """The model-wide top-k buffer every layer of this process shares (one per device and
        checkpoint ``index_topk``, ``width``; None: :func:`index_topk`)."""
        key = (torch.device(device), index_topk() if width is None else width)
        buffer = self._topk_buffers.get(key)
        if buffer is None:
            buffer = torch.full((MAX_NUM_BATCHED_TOKENS, key[1]), -1, dtype=torch.int32, device=key[0])
            self._topk_buffers[key] = buffer
        return buffer

    # ---- stage 1 -----------------------------------------------------------
    def filter_index(
        self,
        topk,
        token_to_req,
        block_table,
        is_valid_token,
        *,
        bs,
        world_size,
        rank,
        interleave,
        rho,
    ):
        layer = self._port_layer(topk.device, world_size, rank, interleave, rho=rho)
        with self.calling(layer):
            return layer._compressed_topk_to_slots(
                topk.to(torch.int32),
                token_to_req.to(torch.int32),
                block_table,
                bs,
                is_valid_token.bool(),
            )

    def _port_layer(self, device, world_size, rank, interleave, *, rho, head_dim=64, backend="a2a"):
        """A layer of that rank and compress ratio; ``interleave`` in states (its
        ``cp_kv_cache_interleave_size`` is set in tokens, as the server sets it),
        ``backend`` the DSV41_DCP_COMBINE it is built under."""
        key = (torch.device(device), world_size, rank, interleave, rho, head_dim, backend)
        layer = self._port_layers.get(key)
        if layer is None:
            group = _FilterGroup(world_size, rank, device)
            spec = LayerSpec(
                layer_id=0,
                rho=rho,
                bs=1,
                interleave=interleave,
                world_size=world_size,
                rank=rank,
                local_heads=self.conventions.local_heads,
                head_dim=head_dim,
                window=128,
                sink=torch.zeros(self.conventions.local_heads),
                topk_buffer=self.topk_buffer(device),
                max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                max_model_len=DEFAULT_MAX_MODEL_LEN,
            )
            layer, _ = build_port_layer(self.tree, group, spec, backend=backend, prefill_token_chunk=None)
            self._port_layers[key] = layer
        return layer

    def slot_mapping(
        self,
        positions,
        token_to_req,
        block_table,
        *,
        rho,
        bs,
        world_size,
        rank,
        interleave,
    ):
        return self.vllm.slot_mapping(
            positions,
            token_to_req,
            block_table,
            rho=rho,
            bs=bs,
            world_size=world_size,
            rank=rank,
            interleave=interleave,
        )

    # ---- stage 9: one _dcp_prefill_gather call each -------------------------
    def prefill_geometry(self, seq_lens, *, rho, bs, world_size):
        layer = self._port_layer(seq_lens.device, world_size, 0, 1, rho=rho)
        with self.calling(layer):
            return prefill.geometry(layer, seq_lens, rho=rho, bs=bs)

    def prefill_gather(self, comp_cache, block_table, geometry, group, *, bs):
        layer = self._port_layer(group.device, group.world_size, group.rank_in_group, 1, rho=geometry.rho)
        with self.calling(layer):
            return prefill.gather(layer, comp_cache, block_table, geometry, group, bs=bs)

    def prefill_remap(self, topk, token_to_req, is_valid_token, geometry, *, bs, world_size, interleave):
        layer = self._port_layer(topk.device, world_size, 0, interleave, rho=geometry.rho)
        with self.calling(layer):
            return prefill.remap(layer, topk, token_to_req, is_valid_token, geometry, bs=bs)

    # ---- stage 3 -----------------------------------------------------------
    def combine(self, out, lse, group, *, backend="ag_rs", lse_base=2.0, return_lse=False):
        """The port's ``_run_sm120_dcp`` where the port can be given the case
        (:func:`.combine.in_port_domain`); vLLM's combine, as that step calls it, elsewhere."""
        if not in_port_domain(
            out, group, lse_base=lse_base, return_lse=return_lse, local_heads=self.conventions.local_heads
        ):
            return self.vllm.combine(out, lse, group, backend=backend, lse_base=lse_base, return_lse=return_lse)
        num_tokens = out.shape[0]
        no_window = torch.full((num_tokens, 1, 1), -1, dtype=torch.int32, device=out.device)
        no_lens = torch.zeros(num_tokens, dtype=torch.int32, device=out.device)
        sink = torch.zeros(self.conventions.local_heads)
        merged, _ = self._port_step(out, lse, sink, no_window, no_lens, group, backend)
        return merged

    def fused_combine(self, out, lse, sink, swa_indices, swa_lens, group, *, backend="ag_rs"):
        merged, handed = self._port_step(out, lse, sink, swa_indices, swa_lens, group, backend)
        return merged, handed.sink, handed.swa_indices, handed.swa_lens

    def _port_step(self, out, lse, sink, swa_indices, swa_lens, group, backend):
        layer = self._port_layer(
            out.device, group.world_size, group.rank_in_group, 1, rho=1, head_dim=out.shape[2], backend=backend
        )
        return run_step(layer, out, lse, sink, swa_indices, swa_lens, group, calling=self.calling)

    def build_attention(
        self,
        layout,
        group,
        *,
        backend="ag_rs",
        prefill_gather=None,
        prefill_token_chunk=None,
        max_model_len=DEFAULT_MAX_MODEL_LEN,
        stack=None,
        index_topk=None,
        kv_pool_offset=None,
        **options,
    ):
        """The served options (:data:`SERVED_OPTIONS`, the production profile's): ``index_topk``, the
        checkpoint's top-k width (one vLLM serves under DCP); ``kv_pool_offset``, bytes past which the
        compressed cache's pages sit in its KV pool (:mod:`dcpcheck.impls.dsv41.server.kv_pool`)."""
        if options:
            raise TypeError(f"build_attention: unknown options {sorted(options)}")
        if layout.world_size != group.world_size:
            raise ValueError(
                f"KV layout for W={layout.world_size} on a DCP group of {group.world_size} ranks: in vLLM both "
                "are decode_context_parallel_size"
            )
        if layout.rho >= 1 and (layout.bs < 1 or layout.interleave < 1 or layout.bs % layout.interleave):
            # VllmConfig refuses this before any builder exists (vllm/config/parallel.py):
            # the block size must be a multiple of cp_kv_cache_interleave_size.
            raise ValueError(
                f"KV layout bs={layout.bs}, S={layout.interleave}: vLLM needs block_size % "
                f"cp_kv_cache_interleave_size == 0 (here {layout.bs * layout.rho} % {layout.interleave * layout.rho})"
            )
        served = sources.served_topk_widths()
        if index_topk is not None and index_topk not in served:
            raise ValueError(f"index_topk={index_topk}: vLLM serves {', '.join(map(str, served))} under DCP")
        if kv_pool_offset is not None and kv_pool_offset < 0:
            raise ValueError(f"kv_pool_offset={kv_pool_offset}: a byte offset is 0 or more")
        check_stage_gate(self.tree, group, world_size=group.world_size)
        if prefill_gather is None:
            prefill_gather = os.environ.get("DSV41_DCP_PREFILL_GATHER", "0") == "1"
        self._layers_built += 1
        return PortAttention(
            self,
            layout,
            group,
            stack=stack,
            layer_id=self._layers_built if stack is None else stack.layer_id,
            backend=backend,
            prefill_gather=prefill_gather,
            prefill_token_chunk=prefill_token_chunk,
            max_model_len=max_model_len,
            topk_width=index_topk,
            kv_pool_offset=kv_pool_offset,
        )

    # ---- answers asked before launch ----------------------------------------
    def unavailable_reason(self, terms):
        """vLLM's combine limits (its combine is the port's), and LSE bases the port never uses."""
        reason = self.vllm.unavailable_reason(terms)
        if reason:
            return reason
        if "stage3_prefill_trace" in terms.properties and terms.device == "cpu" and terms.world_size >= 4:
            # A machine limit: vLLM's a2a pack/unpack kernels run a program per
            # token and head under the Triton interpreter.
            return (
                "vLLM's dcp_a2a_lse_reduce under the Triton interpreter takes over 300 s for this trace at "
                f"W={terms.world_size} on CPU; it runs at W <= 2 here and at every W on a GPU (gpu_ci's dsv41 session)"
            )
        if "v40_ratios" in terms.properties:
            refusals = [refusal for refusal in map(self._ratio_refusal, (4, 128)) if refusal]
            if refusals:
                return (
                    "DeepSeek-V4.0's C4A/C128A shapes (compress ratios 4 and 128): the tree's "
                    f"DeepseekV4Attention.__init__ refuses them ({'; '.join(refusals)})"
                )
        if terms.lse_base is not None and terms.lse_base not in self.conventions.lse_bases:
            return (
                f"the DCP2 port calls the combine with base-2 LSEs only (is_lse_base_on_e=False), "
                f"not base {terms.lse_base:g}"
            )
        return None

    def _ratio_refusal(self, rho: int) -> str | None:
        if rho not in self._ratio_refusals:
            self._ratio_refusals[rho] = tree_refusal(self.tree, rho)
        return self._ratio_refusals[rho]

    def known_defect(self, terms):
        """The port's own defects first, then vLLM's (the write side and the combine are the tree's), told by reach."""
        return KnownFailure.joined(
            [port_defect(terms, self.findings), inherited_defect(self.vllm.matching_defects(terms))]
        )


class _FilterGroup:
    """The group a layer is built with: the filter makes no collective, and the
    calls that make one (the prefill gather, the combine step) are given their group."""

    def __init__(self, world_size, rank, device):
        self.world_size, self.rank_in_group, self.device = (
            world_size,
            rank,
            torch.device(device),
        )
