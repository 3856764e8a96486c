"""Known defects of the seed DCP2 port, keyed on contract terms; each reason
names the seed line and points at docs/dsv41.md."""

from __future__ import annotations

INTERLEAVE_UNIT = (
    "seed DCP2 port: the read side passes self.cp_kv_cache_interleave_size (vLLM's unit: tokens) as an "
    "interleave in compressed states, to triton_filter_and_convert_dcp_index in _compressed_topk_to_slots and "
    "to the remap in _dcp_prefill_gather (diff lines 'cp_kv_cache_interleave_size=self.cp_kv_cache_interleave_size' "
    "and 'K = self.cp_kv_cache_interleave_size'), while vLLM's write side and its own indexer use "
    "cp_kv_cache_interleave_size // compress_ratio: at W > 1 and compress ratio > 1 the ranks read states "
    "other than those written (or the filter asserts BLOCK_SIZE % interleave); docs/dsv41.md, defect 1"
)


def port_defect(terms) -> str | None:
    if terms.world_size > 1 and "multi_token_interleave" in terms.properties:
        return INTERLEAVE_UNIT
    return None
