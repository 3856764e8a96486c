"""The DSV4.1 topology generator makes only layer orders vLLM can build."""

from __future__ import annotations

import itertools

import pytest

from dcpcheck.scenarios.topology import Dsv41Topology


def every_topology(num_layers: int):
    """Every config of ``num_layers`` layers the generator accepts."""
    for ratios in itertools.product((0, 1, 2), repeat=num_layers):
        compressed = [layer for layer, ratio in enumerate(ratios) if ratio]
        subsets = [
            subset for size in range(1, len(compressed) + 1) for subset in itertools.combinations(compressed, size)
        ]
        for kv_sources, index_sources in itertools.product(subsets or [()], repeat=2):
            try:
                yield Dsv41Topology(ratios, kv_sources, index_sources)
            except ValueError:
                continue


def test_no_layer_reads_a_kv_source_after_a_later_one():
    """No "S, X, S-consumer": once a later kv source X exists, no layer at or
    after it reads S's cache (vLLM: the latest kv source at or below)."""
    checked = 0
    for topology in every_topology(4):
        specs = topology.layer_specs(interleave_tokens=2, tokens_per_page=16, top_k=4)
        for reader, spec in enumerate(specs):
            if spec.kv_source is None:
                continue
            later_sources = [s for s in topology.kv_source_layer_ids if spec.kv_source < s <= reader]
            assert not later_sources, f"{topology}: layer {reader} reads {spec.kv_source} after {later_sources}"
            checked += 1
    assert checked > 100  # the enumeration reached consumer layers


@pytest.mark.parametrize(
    "config, message",
    [
        (((0, 4), (1,), (1,)), "compress ratio 4; DeepSeek-V4.1 has (0, 1, 2)"),
        (((1, 2), (0,), (0,)), "a cache is read at its own ratio"),
        (((0, 1), (0,), (1,)), "is not a compressed layer"),
        (((1, 1), (1,), (0, 1)), "has no kv source and index source at or below it"),
    ],
)
def test_configs_vllm_cannot_build_are_refused(config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Dsv41Topology(*config)


def test_an_interleave_that_is_not_a_multiple_of_the_ratio_is_refused():
    topology = Dsv41Topology((0, 2), (1,), (1,))
    assert "not a multiple of the compress ratio 2" in topology.dcp_refusal(1)
    assert topology.dcp_refusal(2) is None
    assert Dsv41Topology((0, 1), (1,), (1,)).dcp_refusal(1) is None  # ratio 1: a state is a token
    with pytest.raises(ValueError, match="not a multiple of the compress ratio 2"):
        topology.layer_specs(interleave_tokens=1, tokens_per_page=16, top_k=4)
    with pytest.raises(ValueError, match="block size to be a multiple of cp_kv_cache_interleave_size"):
        topology.layer_specs(interleave_tokens=6, tokens_per_page=16, top_k=4)
