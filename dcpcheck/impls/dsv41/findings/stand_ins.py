"""The manifest of what the seed port needs from the DCP2 stack that the tree
may lack, and what dcpcheck runs in its place.

The seed diff is one file of a stack that patches many (docs/dsv41.md). Each
entry names a piece the port reads, the vLLM file it would live in, and what
dcpcheck supplies when the tree has none. Where the tree can provide a piece,
its probe asks the tree (detected, never configured) and the suite then runs
the tree's; an entry without a probe is never the tree's here (the reason is
its ``suite`` text). The run header prints every entry (:func:`header_lines`).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dcpcheck.impls.dsv41.tree.sources import DCP_ATTRIBUTES, TOPK_MERGE_CHECK

# tools/build_dsv41_tree.sh appends the timing names after this marker when the tree's file lacks them.
TIMING_MARKER = "dcpcheck: no-op stand-ins"
TIMING_NAMES = ("_PREFILL_TIMING", "_PrefillTimer", "prefill_acc_add")
TIMING_MODULE = "vllm.model_executor.kernels.attention.dsa.candidate_blocks"
METADATA_MODULE = "vllm.models.deepseek_v41.sparse_mla"


@dataclass(frozen=True)
class StandIn:
    piece: str  # what the port reads
    home: str  # the vLLM file (and function) that would provide it
    suite: str  # what dcpcheck runs where the tree lacks it
    tree_provides: Callable | None = None  # impl -> bool, or what of the tree's runs (str); None: never the tree's here

    def line(self, impl) -> str:
        provided = self.tree_provides(impl) if self.tree_provides is not None else False
        if provided:
            detail = f", {provided}" if isinstance(provided, str) else ""
            return f"{self.piece}: the tree's ({self.home}{detail})"
        return f"{self.piece}: stand-in, {self.suite} (the stack's would live in {self.home})"


def timing_names_are_the_trees(impl) -> bool:
    """The tree's candidate_blocks.py defines the timing names itself, not after the build script's marker."""
    source = Path(importlib.import_module(TIMING_MODULE).__file__).read_text()
    own = source.split(TIMING_MARKER)[0]
    return all(name in own for name in TIMING_NAMES)


def metadata_has_seq_lens(impl) -> bool:
    metadata = importlib.import_module(METADATA_MODULE).DeepseekV4FlashMLAMetadata
    return "seq_lens" in {field.name for field in dataclasses.fields(metadata)}


def layer_sets_dcp_attributes(impl) -> bool:
    from dcpcheck.impls.dsv41.server.layer import tree_dcp_attributes  # layer imports this module

    return tree_dcp_attributes(impl.tree) == set(DCP_ATTRIBUTES)


def dcp_group_is_the_trees(impl) -> str | None:
    """The tree's GroupCoordinator, built over the test's process group, and the communicator it runs."""
    from dcpcheck.impls.dsv41.server.coordinator import tree_coordinator  # imports the tree's vLLM

    coordinator = tree_coordinator()
    return None if coordinator is None else coordinator.describe()


def _no_finding(name: str) -> Callable:
    return lambda impl: getattr(impl.findings, name) is None


MANIFEST = (
    StandIn(
        "prefill timing names (" + ", ".join(TIMING_NAMES) + ")",
        "model_executor/kernels/attention/dsa/candidate_blocks.py",
        "no-op definitions appended by tools/build_dsv41_tree.sh (timing off)",
        timing_names_are_the_trees,
    ),
    StandIn(
        "the layer's " + ", ".join(DCP_ATTRIBUTES),
        "models/deepseek_v41/attention.py DeepseekV4Attention.__init__",
        "set from the DCP group and parallel_config.cp_kv_cache_interleave_size, in tokens (decides finding 1)",
        layer_sets_dcp_attributes,
    ),
    StandIn(
        "attn_metadata.seq_lens",
        "models/deepseek_v41/sparse_mla.py DeepseekV4FlashMLAMetadata",
        "global sequence lengths set on the tree's metadata object (read by _dcp_prefill_gather)",
        metadata_has_seq_lens,
    ),
    StandIn(
        "the compressed write side under DCP",
        "models/deepseek_v41/sparse_mla.py DeepseekV4SparseMLAMetadataBuilder.build",
        "vLLM's get_compressed_slot_mapping with dcp_world_size and cp_interleave, as "
        "v1/attention/backends/mla/indexer.py calls it (finding 4)",
        _no_finding("compressed_writer"),
    ),
    StandIn(
        "the sliding-window cache placement under DCP",
        "v1/attention/backends/mla/sparse_swa.py DeepseekV4SWACache.get_kv_cache_spec (dcp_sharded=False)",
        "the window written replicated on every rank, as the port reads it (finding 5)",
        _no_finding("swa_placement"),
    ),
    StandIn(
        "the top-k ids under DCP and the indexer's metadata",
        "model_executor/layers/sparse_attn_indexer.py (the DCP top-k merge), over the metadata of "
        "v1/attention/backends/mla/indexer.py DeepseekV32IndexerMetadataBuilder.build (its per-rank lengths from "
        "v1/attention/backends/utils.py get_dcp_local_seq_lens)",
        "the case's global compressed-state ids written into the model-wide topk_indices_buffer; the builder's "
        "build and get_dcp_local_seq_lens are not run: their one reader is the indexer's scoring and top-k, "
        "CUDA kernels (DeepGEMM's paged MQA logits) that do not run here (the builder's DCP refusal does)",
    ),
    StandIn(
        "the DCP group",
        "distributed/parallel_state.py GroupCoordinator",
        "dcpcheck's group over the test's process group",
        dcp_group_is_the_trees,
    ),
    StandIn(
        "weights, CUDA events",
        "models/deepseek_v41/attention.py DeepseekV4Attention.__init__ after the attention sink",
        "a weightless rest (the padded sink, topk_indices_buffer, block sizes)",
    ),
    StandIn(
        "the KV cache format",
        "the layer's kv_cache_dtype, fp8_ds_mla by default (models/deepseek_v41/attention.py "
        "_resolve_dsv4_kv_cache_dtype; its writers: common/ops/fused_compress_quant_cache.py rope_quant_insert, "
        "the CUDA op fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert)",
        "vLLM's fp8_ds_mla record written in torch, scaled to the case's head dim (nope 7D/8 dims as e4m3 in 7 "
        "tiles of D/8 with UE8M0 scales, rope D/8 dims bf16; 584 bytes at 512) and read by the reference kernel "
        "as FlashInfer's reads it; bf16 pages with --dcp-impl dsv41@bfloat16",
    ),
    StandIn(
        "the sliding-window pages and their metadata",
        "v1/attention/backends/mla/sparse_swa.py DeepseekSparseSWAMetadataBuilder.build",
        "only its FlashMLA tile-scheduler plan (skipped, as on SM120: a CUDA extension), its decode/prefill "
        "split (the suite's step names its decodes) and the runner's SWA KV insert (a CUDA op: the driver "
        "copies the window's rows into their slots); the tree's builder "
        "runs the rest, its window kernels under the Triton interpreter, over pages of the tree's SWA block "
        "size that the driver places out of order",
    ),
    StandIn(
        "the checkpoint's index_topk",
        "the HF config (models/deepseek_v41/nvidia/model.py sizes topk_indices_buffer by it)",
        "the narrowest width the tree's DCP top-k merge accepts (model_executor/layers/sparse_attn_indexer.py "
        f"{TOPK_MERGE_CHECK}; stage 1 runs the wider ones)",
    ),
    StandIn(
        "the SM120 config check",
        "utils/flashinfer.py has_flashinfer_sparse_mla_sm120_config",
        "FlashInfer's answer: (num_q_heads, top_k) in _DECODE_DSV4_DISPATCH, executed from the pinned release's "
        "_sparse_mla_sm120/_policy.py (the real check imports FlashInfer, which loads its CUDA packages)",
    ),
)


def header_lines(impl) -> list[str]:
    """The manifest as the run header prints it, one entry a line."""
    return ["stand-ins for the DCP2 stack (the tree's where it provides one):"] + [
        f"  {entry.line(impl)}" for entry in MANIFEST
    ]
