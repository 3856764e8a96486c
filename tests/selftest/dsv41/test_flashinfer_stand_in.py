"""``--dcp-impl dsv41``'s stand-in for FlashInfer's ``flashinfer.mla._core``
(:mod:`dcpcheck.impls.dsv41.kernels.flashinfer_stand_in`), on a small ``_core.py`` of
this test's: the definitions it names are executed from the file, the entry
keeps the file's signature (Python's own TypeError for a call that does not
bind), finding 6's fix is supplied only where the call omits exactly it, and
``sys.modules`` is as it was after the call. The pinned release's own file is
run by the dsv41 checks (``tests/stage3_combine/test_tree_kernel_call.py``)."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest
import torch

from dcpcheck.impls.dsv41.kernels import reference as reference_kernel
from dcpcheck.impls.dsv41.kernels.flashinfer_sources import CORE, FlashInferSources
from dcpcheck.impls.dsv41.kernels.flashinfer_stand_in import ENTRY, FlashInferCore, FlashInferSourceError

CORE_SOURCE = textwrap.dedent(
    """
    from dataclasses import dataclass
    from typing import Literal, Optional

    import torch
    import flashinfer.jit  # FlashInfer's own imports are not executed


    @dataclass(frozen=True)
    class _SparseMLASegment:
        indices: torch.Tensor
        lengths: Optional[torch.Tensor] = None
        kv_cache: Optional[torch.Tensor] = None


    @dataclass(frozen=True)
    class _NormalizedSparseMLASegment:
        kv_cache: Optional[torch.Tensor]
        indices: torch.Tensor
        lengths: Optional[torch.Tensor]


    def _check_sm120_dsv4_kv_cache_layout(kv_cache, kv_layout, name):
        if kv_cache.ndim not in (3, 4):
            raise ValueError(f"{name}: this file's own layout check")
        return kv_cache


    def _sparse_mla_reshape(tensor, shape, name):
        return tensor.reshape(shape)


    def _normalize_sparse_mla_indices_and_lens(*, indices, lens, batch_size, q_len_per_request, device, name):
        return _sparse_mla_reshape(indices, (batch_size * q_len_per_request, -1), name), lens


    def _normalize_sparse_mla_segments(*, sparse_mla_segments, batch_size, q_len_per_request, device):
        normalized = []
        for segment in sparse_mla_segments:
            indices, lengths = _normalize_sparse_mla_indices_and_lens(
                indices=segment.indices, lens=segment.lengths, batch_size=batch_size,
                q_len_per_request=q_len_per_request, device=device, name="indices",
            )
            normalized.append(_NormalizedSparseMLASegment(segment.kv_cache, indices, lengths))
        return normalized


    def _normalize_optional_mla_sink(sinks, backend_name):
        return sinks


    def _trtllm_batch_decode_sparse_mla_sm120(
        query, kv_cache, workspace_buffer, sparse_mla_segments, out, sm_scale, sinks, lse, return_lse,
        lse_scale: float, kv_scale_format: str, kv_cache_format: Literal["fp8", "nvfp4"] = "fp8",
        backend: Literal["sparse", "cake"] = "sparse",
    ):
        raise RuntimeError("the compiled kernel: never called")
    """
)
HEADS, DIM = 8, 16


@pytest.fixture
def core(tmp_path) -> FlashInferCore:
    (tmp_path / CORE).parent.mkdir(parents=True)
    (tmp_path / CORE).write_text(CORE_SOURCE)
    return FlashInferCore(FlashInferSources("0.0.test", tmp_path))


def _call(core, **overrides):
    """The SM120 entry called as the seed's wrapper calls it (its keywords), with ``overrides``."""
    from flashinfer.mla._core import (  # what the wrapper imports: the stand-in while installed
        _check_sm120_dsv4_kv_cache_layout,
        _SparseMLASegment,
        _trtllm_batch_decode_sparse_mla_sm120,
    )

    gen = torch.Generator().manual_seed(0)
    query = torch.randn((2, HEADS, DIM), generator=gen).bfloat16()
    cache = torch.randn((6, 1, DIM), generator=gen).bfloat16()
    indices = torch.tensor([[0, 1, 2], [3, 4, -1]], dtype=torch.int32)
    lens = torch.tensor([3, 2], dtype=torch.int32)
    out = torch.empty_like(query)
    lse = torch.empty((2, HEADS))
    call = dict(
        query=query.unsqueeze(1),
        kv_cache=_check_sm120_dsv4_kv_cache_layout(cache, "NHD", "swa_kv_cache"),
        workspace_buffer=torch.empty(8),
        sparse_mla_segments=[_SparseMLASegment(indices=indices, lengths=lens)],
        out=out.unsqueeze(1),
        sm_scale=0.25,
        sinks=None,
        lse=lse,
        return_lse=True,
        kv_scale_format="auto",
    )
    call.update(overrides)
    _trtllm_batch_decode_sparse_mla_sm120(**{k: v for k, v in call.items() if v is not OMITTED})
    expected_out, expected_lse = torch.empty_like(out), torch.empty_like(lse)
    reference_kernel.sparse_attention_with_lse(
        query, cache, indices, lens, None, None, None, expected_out, 0.25, None, expected_lse
    )
    return out, lse, expected_out, expected_lse


OMITTED = object()


def test_an_omitted_required_argument_is_pythons_typeerror_at_the_entry(core):
    with core.installed(strict=True), pytest.raises(TypeError) as raised:
        _call(core)
    assert str(raised.value) == f"{ENTRY}() missing 1 required positional argument: 'lse_scale'"


def test_finding_6s_fix_is_supplied_outside_its_probe_and_the_reference_kernel_computes(core):
    with core.installed():
        out, lse, expected_out, expected_lse = _call(core)
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"lse_scal": 1.0}, "got an unexpected keyword argument 'lse_scal'"),
        ({"kv_scale_format": OMITTED}, "missing 2 required positional arguments: 'lse_scale' and 'kv_scale_format'"),
    ],
    ids=["misnamed", "another_argument_omitted"],
)
def test_no_other_call_that_does_not_bind_is_mended(core, overrides, message):
    with core.installed(), pytest.raises(TypeError, match=message):
        _call(core, **overrides)


def test_lse_scale_multiplies_the_base2_lse(core):
    with core.installed():
        _, lse, _, expected_lse = _call(core, lse_scale=math.log(2.0))
    torch.testing.assert_close(lse, expected_lse * math.log(2.0))


def test_the_files_own_definitions_run(core):
    with core.installed(), pytest.raises(ValueError, match="this file's own layout check"):
        _call(core, kv_cache=core.module._check_sm120_dsv4_kv_cache_layout(torch.empty(2), "NHD", "kv_cache"))


def test_a_kv_cache_format_outside_the_files_literal_is_refused(core):
    with (
        core.installed(),
        pytest.raises(ValueError, match=r"kv_cache_format='fp8_ds_mla'; accepted: \('fp8', 'nvfp4'\)"),
    ):
        _call(core, lse_scale=1.0, kv_cache_format="fp8_ds_mla")


def test_sys_modules_is_as_it_was_after_the_call(core):
    before = {name: sys.modules.get(name) for name in ("flashinfer", "flashinfer.mla", "flashinfer.mla._core")}
    with core.installed():
        assert sys.modules["flashinfer.mla._core"] is core.module
    assert {name: sys.modules.get(name) for name in before} == before


def test_a_source_without_a_needed_definition_is_named(tmp_path):
    (tmp_path / CORE).parent.mkdir(parents=True)
    (tmp_path / CORE).write_text(CORE_SOURCE.replace("def _normalize_optional_mla_sink", "def _renamed"))
    with pytest.raises(FlashInferSourceError, match="has no _normalize_optional_mla_sink"):
        FlashInferCore(FlashInferSources("0.0.test", tmp_path))
