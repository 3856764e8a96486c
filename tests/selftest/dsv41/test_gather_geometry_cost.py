"""The instrument behind ``--dcp-impl dsv41``'s "prefill gather geometry" cost
line: host reads of ``attn_metadata.seq_lens`` counted over one gathered step
of layers in two interleaved KV groups, on stand-in layers whose geometry
cache is reset at each metadata switch (as the seed port's is) or kept per
metadata object."""

from __future__ import annotations

import pytest

from dcpcheck.impls.dsv41.probes.gather_cost import GEOMETRY_STACK, gather_geometry_reads


class GeometryPerStepLayer:
    """Keeps one geometry, recomputed whenever the metadata object changes."""

    shared: dict = {}

    def _dcp_prefill_gather(self, cache, topk, token_to_req, is_valid, metadata, num_decodes, num_prefills, bs):
        if self.shared.get("meta") is not metadata:
            self.shared["meta"] = metadata
            self.shared["geom"] = metadata.seq_lens[num_decodes : num_decodes + num_prefills].tolist()
        return self.dcp_group.all_gather(cache[:1], dim=0)


class GeometryPerMetadataLayer:
    """Keeps a geometry per metadata object."""

    shared: dict = {}

    def _dcp_prefill_gather(self, cache, topk, token_to_req, is_valid, metadata, num_decodes, num_prefills, bs):
        if id(metadata) not in self.shared:
            self.shared[id(metadata)] = metadata.seq_lens[num_decodes : num_decodes + num_prefills].tolist()
        return self.dcp_group.all_gather(cache[:1], dim=0)


@pytest.mark.parametrize(
    "layer_cls, reads",
    [(GeometryPerStepLayer, len(GEOMETRY_STACK)), (GeometryPerMetadataLayer, len(set(GEOMETRY_STACK)))],
    ids=["reset_at_each_switch", "kept_per_metadata"],
)
def test_host_reads_are_counted_per_recompute(layer_cls, reads):
    layer_cls.shared.clear()
    layers = {rho: layer_cls() for rho in set(GEOMETRY_STACK)}
    for layer in layers.values():
        layer.dcp_group = None
    counted, objects = gather_geometry_reads(lambda rank, rho: layers[rho], topk_width=512)
    assert (counted, objects) == (reads, len(set(GEOMETRY_STACK)))
