"""The embedded DCP2 port as one implementation object.

Each capability is a plain function of a stage module; mutants subclass
:class:`EmbeddedPort` and replace exactly one of them.
"""

from __future__ import annotations

from . import attention, combine, gate, index, prefill


class EmbeddedPort:
    name = "port"

    filter_index = staticmethod(index.filter_index)
    slot_mapping = staticmethod(index.slot_mapping)

    gather_heads = staticmethod(attention.gather_heads)
    sparse_attention = staticmethod(attention.sparse_attention)
    partial_attention = staticmethod(attention.partial_attention)
    combine = staticmethod(combine.combine)
    dcp_attention = staticmethod(attention.dcp_attention)

    prefill_geometry = staticmethod(prefill.prefill_geometry)
    prefill_gather = staticmethod(prefill.prefill_gather)
    prefill_remap = staticmethod(prefill.prefill_remap)

    def build_attention(self, layout, group, **options):
        """The DCP attention layer, composed of this object's capabilities."""
        return gate.build_attention(self, layout, group, **options)
