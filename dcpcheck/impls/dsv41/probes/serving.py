"""How the tree serves the port, asked of the tree's own code: the compressed
write side (its DSV4.1 metadata builder), the interleave unit of the port's
read side, and where the sliding-window cache lives under DCP.

Each question is a small probe (a module of this folder) run once, at W = 2, compress ratio 2 and a
2-token ``--cp-kv-cache-interleave-size`` (one state per rank in turn, the
smallest case where tokens and states differ). Its answer decides which
findings the checks report and which write side the driver uses; vLLM's own
DCP writer (``get_compressed_slot_mapping`` called with ``dcp_world_size``
and ``cp_interleave``, as vLLM's indexer calls it) is the reference placement.
"""

from __future__ import annotations

import functools

from dcpcheck.impls.dsv41.probes.backend_agreement import backend_agreement_finding
from dcpcheck.impls.dsv41.probes.capture_metadata import capture_metadata_finding
from dcpcheck.impls.dsv41.probes.combine_context import combine_context_finding
from dcpcheck.impls.dsv41.probes.common import probe_device
from dcpcheck.impls.dsv41.probes.gather_cost import GEOMETRY_STACK, gather_geometry_reads
from dcpcheck.impls.dsv41.probes.head_counts import head_count_finding
from dcpcheck.impls.dsv41.probes.kernel_call import kernel_call_finding
from dcpcheck.impls.dsv41.probes.kernel_envelope import kernel_envelope_answer
from dcpcheck.impls.dsv41.probes.reader import reader_finding
from dcpcheck.impls.dsv41.probes.refusal import refusal_finding
from dcpcheck.impls.dsv41.probes.swa import swa_finding
from dcpcheck.impls.dsv41.probes.writer import writer_finding
from dcpcheck.impls.dsv41.server.layer import index_topk
from dcpcheck.impls.dsv41.tree.loading import PortTree

# The probes' names: each probe's check fails with "NAME: finding".
COMPRESSED_WRITER = "compressed writer"
READ_UNIT = "read side's interleave unit"
SWA_CACHE_PLACEMENT = "sliding-window cache placement"
FLASHINFER_KERNEL_CALL = "FlashInfer kernel call"
DCP_REFUSAL = "indexer's DCP refusal"
HEAD_COUNTS = "DCP head counts"
COMBINE_CONTEXT = "combine launch context"
KERNEL_ENVELOPE = "SM120 kernel envelope"
BACKEND_AGREEMENT = "per-rank backend agreement"
CAPTURE_METADATA = "graph-capture metadata"


class ServingFindings:
    """The probes' answers for one tree, each asked once, when first needed."""

    def __init__(self, tree: PortTree, vllm, build_layer):
        self._tree, self._vllm, self._build_layer = tree, vllm, build_layer

    @functools.cached_property
    def compressed_writer(self) -> str | None:
        return writer_finding(self._tree, self._vllm)

    @functools.cached_property
    def read_unit(self) -> str | None:
        return reader_finding(self._build_layer, self._vllm)

    @functools.cached_property
    def swa_placement(self) -> str | None:
        return swa_finding(self._tree)

    @functools.cached_property
    def kernel_call(self) -> str | None:
        return kernel_call_finding(self._tree, probe_device())

    @functools.cached_property
    def _kernel_envelope(self) -> tuple[str | None, str]:
        return kernel_envelope_answer(self._tree)

    @property
    def kernel_envelope(self) -> str | None:
        """A served shape the SM120 kernel has no specialisation for, named; None if it has one for each."""
        return self._kernel_envelope[0]

    @property
    def kernel_envelope_summary(self) -> str:
        """The run header's answer of the envelope probe."""
        return self._kernel_envelope[1]

    @functools.cached_property
    def gather_geometry_cost(self) -> str:
        """What the prefill gather's geometry costs across KV groups (a measured cost, never a failure)."""
        if not callable(getattr(self._build_layer(0, 1), "_dcp_prefill_gather", None)):
            return "not measured (the layer has no _dcp_prefill_gather)"
        try:
            reads, objects = gather_geometry_reads(self._build_layer, index_topk())
        except Exception as exc:  # noqa: BLE001 - a port with another gather signature: the header says so
            return f"not measured (_dcp_prefill_gather raised {type(exc).__name__}: {exc})"
        return (
            f"{reads} host reads of attn_metadata.seq_lens (a sync each on CUDA) in one gathered prefill step "
            f"over layers of compress ratios {', '.join(map(str, GEOMETRY_STACK))}, where the runner gives "
            f"{objects} metadata objects"
        )

    @functools.cached_property
    def head_counts(self) -> str | None:
        return head_count_finding(self._tree)

    @functools.cached_property
    def combine_context(self) -> str | None:
        return combine_context_finding(self._build_layer)

    @functools.cached_property
    def capture_metadata(self) -> str | None:
        return capture_metadata_finding(self._tree, self._vllm)

    @functools.cached_property
    def backend_agreement(self) -> str | None:
        return backend_agreement_finding(self._tree)

    @functools.cached_property
    def dcp_refusal(self) -> str | None:
        return refusal_finding(self._tree)

    def by_name(self) -> dict[str, str | None]:
        return {
            DCP_REFUSAL: self.dcp_refusal,
            HEAD_COUNTS: self.head_counts,
            COMBINE_CONTEXT: self.combine_context,
            BACKEND_AGREEMENT: self.backend_agreement,
            CAPTURE_METADATA: self.capture_metadata,
            COMPRESSED_WRITER: self.compressed_writer,
            READ_UNIT: self.read_unit,
            SWA_CACHE_PLACEMENT: self.swa_placement,
            FLASHINFER_KERNEL_CALL: self.kernel_call,
            KERNEL_ENVELOPE: self.kernel_envelope,
        }
