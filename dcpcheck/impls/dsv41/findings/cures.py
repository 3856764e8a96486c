"""The port as it would be with a finding fixed, for one rerun of a case
(``KnownFailure.cures``): each cure names a finding and neutralises its cause
on a layer for the duration of one call into it, so that a second bug on the
same layers still fails the case (docs/dsv41.md, "No bug behind a finding")."""

from __future__ import annotations

import contextlib

from dcpcheck.impls.dsv41.tree.loading import patched

# Finding 1: the read side reads compressed states in the unit vLLM's DCP writer
# writes them in (cp_kv_cache_interleave_size // compress_ratio, as
# v1/attention/backends/mla/indexer.py passes it to get_compressed_slot_mapping).
READ_UNIT_IN_STATES = "read_unit_in_states"
# Finding 2: each layer's top-k remapped afresh (the step's remaps are keyed by the shared buffer's address);
# the step's gathered pages stay cached, as the port keeps them (once per kv source and step).
REMAP_PER_INDEX_SOURCE = "remap_per_index_source"
# Finding 7: a fresh CPTritonContext for each combine (vLLM's own callers pass none).
COMBINE_CONTEXT_PER_CALL = "combine_context_per_call"
CURES = (READ_UNIT_IN_STATES, REMAP_PER_INDEX_SOURCE, COMBINE_CONTEXT_PER_CALL)


def _cure(layer, cure: str):
    """A context manager: one cure applied to ``layer`` for one call into it."""
    if cure == READ_UNIT_IN_STATES:
        ratio = max(layer.compress_ratio, 1)
        return patched(layer, cp_kv_cache_interleave_size=layer.cp_kv_cache_interleave_size // ratio)
    if cure == REMAP_PER_INDEX_SOURCE:
        type(layer)._dcp_gather_cache["idx"] = {}
        return contextlib.nullcontext()
    if layer._cp_ctx is None:
        return contextlib.nullcontext()
    return patched(layer, _cp_ctx=type(layer._cp_ctx)())


def cured_layer(layer, cures: tuple[str, ...]):
    """A context manager: ``layer`` with ``cures`` applied for one call into it (none: as it is)."""
    stack = contextlib.ExitStack()
    for cure in cures:
        stack.enter_context(_cure(layer, cure))
    return stack


def check_cures(cures: tuple[str, ...]) -> tuple[str, ...]:
    unknown = [cure for cure in cures if cure not in CURES]
    if unknown:
        raise ValueError(f"dsv41 has no cure {', '.join(map(repr, unknown))}; it cures {', '.join(CURES)}")
    return cures
