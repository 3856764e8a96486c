"""Known defects of the seed DCP2 port, keyed on contract terms; each reason
names the seed line and points at docs/dsv41.md. And the reach of vLLM's own
defects (the port calls vLLM's functions): which of them the port's call sites
can meet, and why the others cannot."""

from __future__ import annotations

import re

from dcpcheck.impls.dsv41.findings.cures import COMBINE_CONTEXT_PER_CALL, READ_UNIT_IN_STATES, REMAP_PER_INDEX_SOURCE
from dcpcheck.impls.dsv41.probes.kernel_call import LSE_SCALE_MISSING
from dcpcheck.impls.dsv41.probes.serving import (
    BACKEND_AGREEMENT,
    COMBINE_CONTEXT,
    COMPRESSED_WRITER,
    FLASHINFER_KERNEL_CALL,
    KERNEL_ENVELOPE,
    READ_UNIT,
    SWA_CACHE_PLACEMENT,
)
from dcpcheck.impls.protocol import NOT_ON_PORT_PATH, KnownFailure

# vLLM 0.33.0's defects (dcpcheck.impls.vllm_adapter.KNOWN_DEFECTS) the port's
# call sites never meet, each with why; a defect not listed here is on its path.
OFF_PORT_PATH = {
    "short_table_write": "vLLM sizes every block-table row for max_model_len "
    "(v1/worker/gpu_model_runner.py, max_num_blocks_per_req), so no served request has a short row",
    "ag_rs_single_rank": "the port combines only at dcp_world_size > 1 (_run_sm120_dcp is called under that test)",
    "finite_empty_band": "DCP rank 0 folds the finite learned sink into every row (_dcp_attn_sink) and the port "
    "needs unpadded heads, so no row is empty on every rank",
    "fp32_rounded_lse": "the port's partials are bf16 (_run_sm120_dcp's out_gathered), where the rounding is far "
    "below one ulp",
}

INTERLEAVE_UNIT = (
    "the port's read side reads compressed states in another interleave unit than vLLM's DCP writer writes them "
    "(the seed DCP2 port passes self.cp_kv_cache_interleave_size, vLLM's unit: tokens, as an interleave in "
    "states, to triton_filter_and_convert_dcp_index in _compressed_topk_to_slots and to the remap in "
    "_dcp_prefill_gather: diff lines 'cp_kv_cache_interleave_size=self.cp_kv_cache_interleave_size' and "
    "'K = self.cp_kv_cache_interleave_size'; vLLM's writer and its own indexer use "
    "cp_kv_cache_interleave_size // compress_ratio); docs/dsv41.md, finding 1; probed"
)
WRITE_SIDE_MISSING = "docs/dsv41.md, finding 4"
SWA_PLACEMENT = "docs/dsv41.md, finding 5"
KERNEL_CALL = "docs/dsv41.md, finding 6"
SHAPE_ENVELOPE = "docs/dsv41.md, 'The SM120 kernel's shape envelope at start-up'; probed"
COMBINE_CONTEXT_REUSED = "docs/dsv41.md, finding 7; probed"
BACKENDS_PER_RANK = "docs/dsv41.md, finding 8; probed"
STALE_INDEX_CACHE = (
    "seed DCP2 port: _dcp_prefill_gather caches the remapped top-k per step under "
    "'ikey = (topk_indices.data_ptr(), tuple(topk_indices.shape))', but every layer reads its top-k from the one "
    "model-wide topk_indices_buffer, so a second index-source layer of the same KV group in the step gets the "
    "first one's slots; docs/dsv41.md, finding 2"
)

STAGE_VALUE_EMPTY = (
    'seed DCP2 port: the builder gate reads \'int(os.environ.get("DSV41_DCP_STAGE", "3"))\', so '
    "DSV41_DCP_STAGE= (empty: unset) crashes the boot with ValueError: invalid literal for int(); "
    "docs/dsv41.md, finding 3"
)
STAGE_VALUE_NOT_INTEGER = (
    'seed DCP2 port: the builder gate\'s int(os.environ.get("DSV41_DCP_STAGE", "3")) refuses \'3a\' with '
    "\"invalid literal for int() with base 10: '3a'\", which names neither the variable nor what it accepts; "
    "docs/dsv41.md, finding 3"
)


# How each defect fails a case: the probe's own check, or the layer it
# first breaks (a ratio-2 layer for the interleave unit, a later layer on the
# gather path for the stale index cache); any other failure is news.
SHOWS_PROBE = "{probe}: "
# A ratio-2 layer's output: an e2e stack's layer, stage 9's gathered prefill, or a production step's.
SHOWS_RATIO2_LAYER = (
    r"DCP-W vs [^(]*\(stage=e2e [^()]*layer=\d+ \(rho 2\)\)|gathered prefill vs [^(]*\(stage=9 [^()]*rho=2 "
    r"|production step vs [^(]*\(stage=production [^()]*rho=2 "
)
SHOWS_STAGE1_READS = r"states read by rank \d+ vs the oracle"
SHOWS_RELAUNCH_REFUSED = r"TypeError: function takes exactly \d+ arguments \(\d+ given\)"
SHOWS_STAGE9_REMAP = r"gathered-buffer slot of each top-k id vs the oracle: \d+ problem"
# An interleave read in tokens as states can exceed a page: vLLM's filter refuses it.
SHOWS_INTERLEAVE_OVER_PAGE = r"BLOCK_SIZE \(\d+\) must be divisible by cp_kv_cache_interleave_size \(\d+\)"
SHOWS_LATER_GATHER_LAYER = r"DCP-W vs [^(]*\(stage=e2e [^()]*prefill=gather [^()]*layer=[1-9]\d* \(rho \d+\)\)"
SHOWS_EMPTY_STAGE = (
    r"DSV41_DCP_STAGE='', [^:]*: build_attention must build .*invalid literal for int\(\) with base 10: ''"
)
SHOWS_NOT_INTEGER = r"DSV41_DCP_STAGE='3a', [^:]*: the error must name DSV41_DCP_STAGE .*invalid literal for int\(\)"


def _probed(probe: str, finding: str, where: str) -> KnownFailure:
    return KnownFailure(f"{finding}; {where}", re.escape(SHOWS_PROBE.format(probe=probe)))


def port_defect(terms, findings) -> KnownFailure | None:
    """The port's own defects a case meets; ``findings``: the tree's
    :class:`dcpcheck.impls.dsv41.probes.serving.ServingFindings`, asked only where a case needs one."""
    defects = []
    if "tree_compressed_writer" in terms.properties and findings.compressed_writer:
        defects.append(_probed(COMPRESSED_WRITER, findings.compressed_writer, WRITE_SIDE_MISSING))
    if "tree_swa_placement" in terms.properties and findings.swa_placement:
        defects.append(_probed(SWA_CACHE_PLACEMENT, findings.swa_placement, SWA_PLACEMENT))
    if "tree_kernel_call" in terms.properties and findings.kernel_call:
        shows = re.escape(SHOWS_PROBE.format(probe=FLASHINFER_KERNEL_CALL)) + ".*" + re.escape(LSE_SCALE_MISSING)
        defects.append(KnownFailure(f"{findings.kernel_call}; {KERNEL_CALL}", shows))
    if "tree_kernel_envelope" in terms.properties and findings.kernel_envelope:
        defects.append(_probed(KERNEL_ENVELOPE, findings.kernel_envelope, SHAPE_ENVELOPE))
    if "tree_combine_context" in terms.properties and findings.combine_context:
        defects.append(_probed(COMBINE_CONTEXT, findings.combine_context, COMBINE_CONTEXT_REUSED))
    if "tree_backend_agreement" in terms.properties and findings.backend_agreement:
        defects.append(_probed(BACKEND_AGREEMENT, findings.backend_agreement, BACKENDS_PER_RANK))
    if "tree_read_unit" in terms.properties and findings.read_unit:
        defects.append(
            KnownFailure(f"{INTERLEAVE_UNIT}: {findings.read_unit}", re.escape(SHOWS_PROBE.format(probe=READ_UNIT)))
        )
    if terms.world_size < 2:
        return KnownFailure.joined(defects)
    if "dsv41_ratio2" in terms.properties and findings.read_unit:
        # Where a ratio-2 read shows: stage 1's reads, stage 9's remap, or a ratio-2 layer's output.
        shows = [
            shows
            for capability, shows in (
                ("filter_index", SHOWS_STAGE1_READS),
                ("prefill_remap", SHOWS_STAGE9_REMAP),
                ("build_attention", SHOWS_RATIO2_LAYER),
            )
            if capability in terms.capabilities
        ]
        if shows:
            reason = f"{INTERLEAVE_UNIT}: {findings.read_unit}"
            shows = "|".join([*shows, SHOWS_INTERLEAVE_OVER_PAGE])
            defects.append(KnownFailure(reason, shows, (READ_UNIT_IN_STATES,)))
    if (
        "port_heads" in terms.properties
        and terms.backend == "ag_rs"
        and findings.combine_context
        and {"combine", "fused_combine"} & terms.capabilities
    ):
        reason = f"{findings.combine_context}; {COMBINE_CONTEXT_REUSED}"
        defects.append(KnownFailure(reason, SHOWS_RELAUNCH_REFUSED, (COMBINE_CONTEXT_PER_CALL,)))
    if "build_attention" not in terms.capabilities:
        return KnownFailure.joined(defects)
    if "adjacent_index_sources" in terms.properties:
        defects.append(KnownFailure(STALE_INDEX_CACHE, SHOWS_LATER_GATHER_LAYER, (REMAP_PER_INDEX_SOURCE,)))
    if "stage_value_empty" in terms.properties:
        defects.append(KnownFailure(STAGE_VALUE_EMPTY, SHOWS_EMPTY_STAGE))
    if "stage_value_not_integer" in terms.properties:
        defects.append(KnownFailure(STAGE_VALUE_NOT_INTEGER, SHOWS_NOT_INTEGER))
    return KnownFailure.joined(defects)


def inherited_defect(defects) -> KnownFailure | None:
    """vLLM's defects a case meets (:class:`dcpcheck.impls.vllm_adapter.KnownDefect`),
    told by reach: those on the port's path as they are, and when every one is
    off it, one reason that says so (the stage table counts those apart)."""
    if not defects:
        return None
    shows = KnownFailure.joined(KnownFailure(defect.reason, defect.shows) for defect in defects).shows
    on_path = [defect.reason for defect in defects if defect.name not in OFF_PORT_PATH]
    if on_path:
        return KnownFailure("vLLM 0.33.0, on the port's path: " + "; and ".join(on_path), shows)
    reason = f"{NOT_ON_PORT_PATH}: " + "; and ".join(
        f"{defect.reason}; unreachable from the port: {OFF_PORT_PATH[defect.name]}" for defect in defects
    )
    return KnownFailure(reason, shows)
