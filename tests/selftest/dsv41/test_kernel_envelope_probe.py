"""The start-up probe of the served shapes against the SM120 kernel's envelope
(:mod:`dcpcheck.impls.dsv41.probes.kernel_envelope`), on the pinned FlashInfer's own
sources and on copies with one limit changed: a release whose decode kernels stop
at 64 heads, or at 4 tokens (a 5-token MTP decode then routes to prefill, as in
vllm-project/vllm#50720), is a finding naming the served shape."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from dcpcheck.impls.dsv41.kernels.flashinfer_sources import (
    SPARSE_MLA_API,
    SPARSE_MLA_POLICY,
    FlashInferSourcesError,
    pinned_sources,
)
from dcpcheck.impls.dsv41.kernels.kernel_envelope import KernelEnvelope, KernelEnvelopeSourceError
from dcpcheck.impls.dsv41.probes.kernel_envelope import served_shapes, shape_problems


def _pinned():
    try:
        sources = pinned_sources()
    except FlashInferSourcesError as exc:
        pytest.skip(str(exc))
    if not sources.sparse_mla_policy.is_file():
        pytest.skip("the pinned FlashInfer's _sparse_mla_sm120 sources are not unpacked (tools/install_vllm_cpu.sh)")
    return sources


def _pad(heads: int) -> int:
    """vLLM's padding of the rank's heads to the kernel's head set (the seed's _pad_to_supported_q_heads)."""
    return next(supported for supported in (8, 16, 32, 64, 128) if heads <= supported)


def _changed(tmp_path, old: str, new: str) -> KernelEnvelope:
    """The pinned release's envelope with ``old`` replaced by ``new`` in its _policy.py."""
    sources = _pinned()
    for name in (SPARSE_MLA_POLICY, SPARSE_MLA_API):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(sources.root / name, tmp_path / name)
    policy = tmp_path / SPARSE_MLA_POLICY
    text = policy.read_text()
    assert text.count(old) == 1, f"FlashInfer {sources.version}'s _policy.py changed: edit this test"
    policy.write_text(text.replace(old, new))
    return KernelEnvelope(dataclasses.replace(sources, root=tmp_path))


def _problems(envelope: KernelEnvelope) -> dict[str, list]:
    found: dict[str, list] = {}
    for shape in served_shapes(_pad):
        for problem in shape_problems(envelope, shape):
            found.setdefault(problem, []).append(shape)
    return found


def test_the_pinned_release_has_every_served_shape():
    envelope = KernelEnvelope(_pinned())
    assert _problems(envelope) == {}
    # vLLM's init check is FlashInfer's coarse envelope: it admits 24 heads, which the entry refuses.
    assert envelope.vllm_admits(24, 128) and not envelope.decode_has(24, 128, 1)
    assert not envelope.vllm_admits(256, 128)
    assert not envelope.decode_has(128, 512, envelope.max_decode_tokens + 1)
    assert not envelope.prefill_has(64, 1152 + 32)


def test_a_release_without_128_head_decode_is_a_finding_naming_the_shape(tmp_path):
    found = _problems(_changed(tmp_path, "_DECODE_MAX_HEADS = 128", "_DECODE_MAX_HEADS = 64"))
    problem = next(problem for problem in found if problem.startswith("no decode kernel for 128 heads"))
    assert "vLLM refuses it at init" in " ".join(found)
    assert "DeepSeek-V4.1 (128 heads) on 2 GPUs at TP 2 x DCP 2: 128 kernel heads" in str(found[problem][0])


def test_a_release_whose_decode_stops_at_4_tokens_misses_a_5_token_mtp_decode(tmp_path):
    found = _problems(_changed(tmp_path, "_DECODE_MAX_TOKENS = 64", "_DECODE_MAX_TOKENS = 4"))
    assert any("6 tokens (vLLM's init check admits it: it fails at the first forward)" in problem for problem in found)


def test_a_source_without_the_table_is_one_clear_error(tmp_path):
    with pytest.raises(KernelEnvelopeSourceError, match="has no _DECODE_DSV4_DISPATCH"):
        _changed(tmp_path, "_DECODE_DSV4_DISPATCH = _DecodeDispatchEnvelope(_MODEL_TYPE_DSV4)", "")
