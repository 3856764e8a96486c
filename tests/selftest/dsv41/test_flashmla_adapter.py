"""The adapter from FlashInfer's SM120 entry to FlashMLA's sparse decode
(:mod:`dcpcheck.impls.dsv41.kernels.flashmla`), the kernel selection and the
reference-vs-real cross-check, on CPU: FlashMLA is a recording fake of its
Python interface (``flash_mla_with_kvcache`` of ``sgl-flash-mla`` 1.0.0: its
argument checks and documented conventions, natural-log LSE without the sink),
FlashInfer's SM120 entry a recording stand-in. A planted break of the adapter
(the LSE's base, the sink, the head padding) is caught."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dcpcheck.impls.dsv41.kernels import cross_check, flashmla, reference
from dcpcheck.impls.dsv41.kernels.corner_cases import EMPTY_ROWS, corner_call, through_port_wrapper
from dcpcheck.impls.dsv41.kernels.reference import KernelContractError
from dcpcheck.impls.dsv41.kernels.selection import (
    FLASHINFER_SM120,
    FLASHMLA,
    REFERENCE,
    KernelSelection,
)
from dcpcheck.impls.dsv41.server.kv_cache_format import Fp8DsMlaRecord

REPO = Path(__file__).resolve().parents[3]


class FakeFlashMla:
    """``flash_mla``'s ``get_mla_metadata`` / ``flash_mla_with_kvcache`` as documented, in torch;
    each call's arguments recorded."""

    def __init__(self):
        self.calls = []

    def get_mla_metadata(self, *args, **kwargs):
        return SimpleNamespace(have_initialized=False), None

    def flash_mla_with_kvcache(
        self, q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits=None,
        softmax_scale=None, causal=False, is_fp8_kvcache=None, indices=None, attn_sink=None, extra_k_cache=None,
        extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None, enable_batch_invariant=False,
        use_legacy=False, kv_format=None, descale_q=None, descale_k=None,
    ):  # fmt: skip
        self.calls.append(dict(locals()))
        batch, s_q, heads, dim = q.shape
        assert q.dtype == torch.bfloat16 and dim == 512 and heads in (64, 128) and s_q == 1, "q"
        assert head_dim_v == 512 and not causal and is_fp8_kvcache and use_legacy and kv_format == "V4"
        rows, valid = [], []
        for cache, slots, lens in ((k_cache, indices, topk_length), (extra_k_cache, extra_indices_in_kvcache, extra_topk_length)):  # fmt: skip
            if slots is None:
                continue
            assert cache.dtype == torch.uint8 and cache.dim() == 4 and cache.shape[2:] == (1, 584), "k_cache"
            assert slots.dtype == torch.int32 and slots.shape[:2] == (batch, 1), "indices"
            slots = slots[:, 0].long()
            keep = slots != -1  # "invalid only when it is exactly -1"
            if lens is not None:
                assert lens.dtype == torch.int32 and lens.shape == (batch,), "topk_length"
                keep &= torch.arange(slots.shape[1])[None, :] < lens[:, None]
            assert bool(((slots[keep] >= 0) & (slots[keep] < cache.shape[0] * cache.shape[1])).all()), "no bound check"
            read = Fp8DsMlaRecord(512).read(cache, slots.clamp_min(0))
            rows.append(read.masked_fill(~keep[..., None], 0.0))
            valid.append(keep)
        rows, valid = torch.cat(rows, 1), torch.cat(valid, 1)
        logits = torch.einsum("bhd,bnd->bhn", q[:, 0].float(), rows) * softmax_scale
        logits = logits.masked_fill(~valid[:, None, :], -math.inf)
        lse = torch.logsumexp(logits, dim=2)  # natural log, no sink
        out = torch.einsum("bhn,bnd->bhd", torch.exp(logits - lse[..., None]).nan_to_num(0.0), rows)
        if attn_sink is not None:
            assert attn_sink.dtype == torch.float32 and attn_sink.shape == (heads,), "attn_sink"
            out = out * torch.sigmoid(lse - attn_sink)[..., None].nan_to_num(0.0)
        lse = lse.masked_fill(~valid.any(1)[:, None], math.inf)  # an empty row's LSE: +inf, not the contract's
        return out.to(torch.bfloat16)[:, None], lse[..., None]


def selection_on(capability, fake=None, entry=None) -> KernelSelection:
    def missing():
        raise ImportError("not installed")

    return KernelSelection(
        capability=lambda device: capability,
        load_flash_mla=(lambda: fake) if fake else missing,
        load_sm120_entry=(lambda: entry) if entry else missing,
    )


@pytest.mark.parametrize("num_heads", [8, 64, 128])
@pytest.mark.parametrize("sink", [False, True])
def test_flashmla_through_the_adapter_agrees_with_the_reference(num_heads, sink, tmp_path, monkeypatch):
    log = tmp_path / "kernels.jsonl"
    monkeypatch.setenv(cross_check.LOG_ENV, str(log))
    fake = FakeFlashMla()
    call = corner_call(num_heads, sink=sink)
    assert selection_on((9, 0), fake).compute(*call.args()) == FLASHMLA
    (made,) = fake.calls
    heads = 64 if num_heads <= 64 else 128
    assert made["q"].shape == (6, 1, heads, 512) and not made["q"][:, :, num_heads:].any()
    assert made["indices"].shape[-1] % 128 == 0 and made["extra_indices_in_kvcache"].shape[-1] % 128 == 0
    if sink:
        assert torch.isneginf(made["attn_sink"][num_heads:]).all()
        assert torch.equal(made["attn_sink"][:num_heads], call.sinks)
    assert '"kernel": "FlashMLA"' in log.read_text()
    for row in EMPTY_ROWS:
        assert not call.out[row].any()
        want = call.sinks / math.log(2.0) if sink else torch.full((num_heads,), -math.inf)
        torch.testing.assert_close(call.lse[row], want)
    assert torch.isfinite(call.out).all()  # the NaN slot is never read


def _no_base_change(lse_e, empty, sinks):
    return lse_e.masked_fill(empty, -math.inf)


def _sink_left_out_of_the_lse(lse_e, empty, sinks):
    return lse_e.masked_fill(empty, -math.inf) / math.log(2.0)


PLANTED = {
    "LSE left natural-log": ("to_sm120_lse", _no_base_change, cross_check.ReferenceKernelFinding),
    "sink left out of the LSE": ("to_sm120_lse", _sink_left_out_of_the_lse, cross_check.ReferenceKernelFinding),
    "sink not passed": ("padded_sink", lambda sinks, heads: None, cross_check.ReferenceKernelFinding),
    "heads not padded": ("padded_heads", lambda num_heads: num_heads, AssertionError),
}


@pytest.mark.parametrize("planted", PLANTED)
def test_a_planted_break_of_the_adapter_is_caught(planted, monkeypatch):
    name, broken, caught = PLANTED[planted]
    monkeypatch.setattr(flashmla, name, broken)
    with pytest.raises(caught) as error:
        selection_on((9, 0), FakeFlashMla()).compute(*corner_call(8, sink=True).args())
    if caught is cross_check.ReferenceKernelFinding:
        assert "rows [" in str(error.value) and "heads [" in str(error.value)


def test_a_finding_names_the_rows_and_heads_that_differ():
    call = corner_call(8, sink=False)
    reference.sparse_attention_with_lse(*call.args())
    real_out, real_lse = call.out.clone(), call.lse.clone()
    real_lse[1, 3] += 0.5
    rows, valid = reference._candidate_rows(call.swa_kv_cache, call.swa_indices, call.swa_lens, "swa", 512)
    comparison = cross_check.compare(
        "fake", call.query, call.sm_scale, None, rows, valid, real_out, real_lse, call.out, call.lse
    )
    assert [(row, head, what) for row, head, what, *_ in comparison.differing] == [(1, 3, "lse")]
    assert "rows [1], heads [3]" in cross_check.finding_message(comparison, 6, 8)


def test_a_read_slot_flashmla_would_not_bound_check_is_refused():
    call = corner_call(8, sink=False)
    call.swa_indices[0, 0] = 10**6
    with pytest.raises(KernelContractError, match="FlashMLA checks no bound"):
        selection_on((9, 0), FakeFlashMla()).compute(*call.args())


@pytest.mark.parametrize(
    "capability, fake, head_dim, kernel, why",
    [
        (None, True, 512, REFERENCE, "no GPU"),
        ((9, 0), True, 64, REFERENCE, "head dim 64"),
        ((9, 0), False, 512, REFERENCE, "FlashMLA does not import"),
        ((10, 0), True, 512, FLASHMLA, "SM100"),
        ((8, 0), True, 512, REFERENCE, "no real DSV4 sparse-MLA kernel"),
        ((12, 1), True, 512, REFERENCE, "a call not made through the SM120 entry"),
    ],
)
def test_which_kernel_computes(capability, fake, head_dim, kernel, why):
    query = torch.zeros(1, 8, head_dim, dtype=torch.bfloat16)
    cache = Fp8DsMlaRecord(head_dim).allocate(1, 4, "cpu")
    chosen, _, reason = selection_on(capability, FakeFlashMla() if fake else None).choose(query, cache, None, None)
    assert (chosen, why in reason) == (kernel, True), reason


class RecordingSm120Entry:
    """FlashInfer's ``_trtllm_batch_decode_sparse_mla_sm120``, recording its call and writing the reference's values."""

    def __init__(self):
        self.calls = []

    def __call__(self, **call):
        self.calls.append(call)
        query, out, lse = call["query"], call["out"], call["lse"]
        flat = query.shape[0] * query.shape[1]
        swa, extra = call["sparse_mla_segments"]
        reference.sparse_attention_with_lse(
            query.reshape(flat, *query.shape[2:]), call["kv_cache"], swa.indices, swa.lengths, extra.kv_cache,
            extra.indices, extra.lengths, out.view(flat, *query.shape[2:]), call["sm_scale"], call["sinks"], lse,
        )  # fmt: skip
        return out, lse


def test_sm120_flashinfers_own_entry_gets_the_ports_call():
    call = corner_call(8, sink=True)
    entry = RecordingSm120Entry()
    segments = (
        SimpleNamespace(kv_cache=None, indices=call.swa_indices, lengths=call.swa_lens),
        SimpleNamespace(kv_cache=call.compressed_kv_cache, indices=call.extra_indices, lengths=call.extra_lens),
    )
    port_call = dict(
        query=call.query.unsqueeze(1), kv_cache=call.swa_kv_cache, sparse_mla_segments=segments, sinks=call.sinks,
        sm_scale=call.sm_scale, out=call.out.unsqueeze(1), lse=call.lse, return_lse=True, lse_scale=0.5,
    )  # fmt: skip
    selection = selection_on((12, 0), entry=entry)
    assert selection.compute(*call.args(), entry_call=port_call) == FLASHINFER_SM120
    (made,) = entry.calls
    assert made["sparse_mla_segments"] is segments and made["kv_cache"] is call.swa_kv_cache
    assert (made["lse_scale"], made["return_lse"]) == (1.0, True)  # the stand-in applies the call's own after
    assert made["out"].data_ptr() == call.out.data_ptr() and made["lse"] is call.lse


def test_the_header_says_which_kernel_and_why():
    assert selection_on(None).describe(torch.device("cpu")) == "the reference kernel (no GPU)"
    assert "FlashMLA not installed" in selection_on((9, 0)).describe(torch.device("cpu")) or "sgl-flash-mla" in (
        selection_on((9, 0)).describe(torch.device("cpu"))
    )


def test_the_ports_wrapper_computes_with_flashmla_through_flashinfers_checks():
    """The tree's ``_sm120_sparse_attention_with_lse`` at head dim 512 over the 584-byte record: FlashInfer's
    entry (its signature and checks) in front, FlashMLA behind it (needs the DCP2 tree on PYTHONPATH)."""
    from dcpcheck.impls.dsv41.tree.loading import PortSpec, PortSpecError, PortTree

    try:
        tree = PortTree(PortSpec())
    except PortSpecError as exc:
        pytest.skip(f"no DCP2 tree to load: {exc}")
    fake = FakeFlashMla()
    tree.flashinfer.selection = selection_on((9, 0), fake)
    call = corner_call(8, sink=True)
    through_port_wrapper(tree.module({}), call)
    (made,) = fake.calls
    assert made["q"].shape == (6, 1, 64, 512) and tree.flashinfer.selection.last.worst <= 1


def test_planted_breaks_stay_out_of_the_kernel_log_gpu_ci_reads(tmp_path):
    log = tmp_path / "kernels.jsonl"
    planted = f"{Path(__file__).relative_to(REPO)}::test_a_planted_break_of_the_adapter_is_caught"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", planted],
        cwd=REPO,
        env={**os.environ, cross_check.LOG_ENV: str(log)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert not log.exists() or not log.read_text(), log.read_text()
