"""DeepSeek-V4.1's layer topology, by the rule vLLM 0.33.0 builds it with
(``vllm/models/deepseek_v41/attention.py``, ``DeepseekV4Attention.__init__``).

Every layer has a compress ratio of 0 (sliding window only), 1 or 2. The
config names the kv sources (layers that own a compressor and a compressed
cache) and the index sources (layers whose indexer publishes a top-k into the
one model-wide buffer). A compressed layer reads the cache of the latest kv
source at or below it and the top-k of the latest index source at or below it
(``max(s for s in sources if s <= layer_id)``); an index source that is not a
kv source shares its kv source's cache. So the layers reading one cache are
contiguous: no layer reads kv source S after a later kv source.

The suite's stacks are generated from such a config (:meth:`Dsv41Topology.layer_specs`);
``--dcp-impl dsv41`` checks that the tree's own ``__init__`` gives each layer
the same sources.
"""

from __future__ import annotations

from dataclasses import dataclass

from dcpcheck.scenarios.layers import LayerSpec

DSV41_COMPRESS_RATIOS = (0, 1, 2)


@dataclass(frozen=True)
class Dsv41Topology:
    """A DSV4.1 config's ``compress_ratios``, ``kv_source_layer_ids`` and
    ``index_source_layer_ids``; invalid ones raise ValueError at construction."""

    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]

    def __post_init__(self):
        for layer_id, ratio in enumerate(self.compress_ratios):
            if ratio not in DSV41_COMPRESS_RATIOS:
                raise ValueError(f"layer {layer_id}: compress ratio {ratio}; DeepSeek-V4.1 has {DSV41_COMPRESS_RATIOS}")
        for name, sources in (("kv", self.kv_source_layer_ids), ("index", self.index_source_layer_ids)):
            for source in sources:
                if not 0 <= source < len(self.compress_ratios) or self.compress_ratios[source] == 0:
                    raise ValueError(f"{name} source {source} is not a compressed layer of {self.compress_ratios}")
        for layer_id, ratio in enumerate(self.compress_ratios):
            if ratio == 0:
                continue
            kv, index = self.kv_source(layer_id), self.index_source(layer_id)
            if kv is None or index is None:
                raise ValueError(f"compressed layer {layer_id} has no kv source and index source at or below it")
            if self.compress_ratios[kv] != ratio or self.compress_ratios[index] != ratio:
                raise ValueError(
                    f"layer {layer_id} (ratio {ratio}) reads kv source {kv} and index source {index} of ratios "
                    f"{self.compress_ratios[kv]} and {self.compress_ratios[index]}: a cache is read at its own ratio"
                )

    def kv_source(self, layer_id: int) -> int | None:
        return _latest_at_or_below(self.kv_source_layer_ids, layer_id, self.compress_ratios[layer_id])

    def index_source(self, layer_id: int) -> int | None:
        return _latest_at_or_below(self.index_source_layer_ids, layer_id, self.compress_ratios[layer_id])

    def dcp_refusal(self, interleave_tokens: int) -> str | None:
        """Why vLLM 0.33.0 refuses to serve this model under DCP with a
        ``--cp-kv-cache-interleave-size`` of ``interleave_tokens``, or None: the
        indexer of an index source of ratio > 1 needs the interleave to cover
        whole states (``v1/attention/backends/mla/indexer.py``,
        ``DeepseekV32IndexerMetadataBuilder.__init__`` raises NotImplementedError;
        its DCP writer would put every state on one rank)."""
        ratios = sorted({self.compress_ratios[source] for source in self.index_source_layer_ids})
        uneven = [ratio for ratio in ratios if ratio > 1 and interleave_tokens % ratio]
        if not uneven:
            return None
        return (
            f"--cp-kv-cache-interleave-size {interleave_tokens} is not a multiple of the compress ratio "
            f"{uneven[0]} of an index source: vLLM's indexer refuses DCP with it "
            "(v1/attention/backends/mla/indexer.py, DeepseekV32IndexerMetadataBuilder.__init__)"
        )

    def layer_specs(self, *, interleave_tokens: int, tokens_per_page: int, top_k: int) -> tuple[LayerSpec, ...]:
        """One :class:`LayerSpec` per layer, under one ``--cp-kv-cache-interleave-size``
        (``interleave_tokens``, vLLM's unit) and one page of ``tokens_per_page``
        for every compressed cache: a ratio-rho layer has ``tokens_per_page //
        rho`` states per page and an interleave of ``interleave_tokens // rho``
        states (vLLM refuses a token interleave that is not a multiple of the
        ratio under DCP: ``v1/attention/backends/mla/indexer.py``)."""
        refusal = self.dcp_refusal(interleave_tokens)
        if refusal:
            raise ValueError(refusal)
        specs = []
        for layer_id, ratio in enumerate(self.compress_ratios):
            if ratio == 0:
                specs.append(LayerSpec(rho=0))
                continue
            if tokens_per_page % interleave_tokens:
                raise ValueError(
                    f"an interleave of {interleave_tokens} tokens with {tokens_per_page}-token pages: vLLM needs "
                    "the block size to be a multiple of cp_kv_cache_interleave_size (vllm/config/parallel.py)"
                )
            kv, index = self.kv_source(layer_id), self.index_source(layer_id)
            specs.append(
                LayerSpec(
                    rho=ratio,
                    bs=tokens_per_page // ratio,
                    interleave=interleave_tokens // ratio,
                    top_k=top_k,
                    kv_source=None if kv == layer_id else kv,
                    index_source=None if index == layer_id else index,
                )
            )
        return tuple(specs)


@dataclass(frozen=True)
class StackPosition:
    """Layer ``layer_id`` of ``topology``: what ``build_attention(stack=...)`` is told."""

    layer_id: int
    topology: Dsv41Topology


def _latest_at_or_below(sources: tuple[int, ...], layer_id: int, ratio: int) -> int | None:
    if ratio == 0:
        return None
    below = [source for source in sources if source <= layer_id]
    return max(below) if below else None
