"""A real DSV4 sparse-MLA kernel against the reference kernel (CUDA): FlashMLA's
sparse decode on SM90/SM100 (``sgl-flash-mla``, ``tools/carry_flashmla.py``)
through dcpcheck's adapter, on the kernel contract's corners at the production
shapes (head dim 512, vLLM's 584-byte fp8_ds_mla record; 8, 64 and 128 heads;
with and without a sink), and through the DCP2 port's own SM120 wrapper with
FlashInfer's entry in front. A difference beyond CONTRACT.md §8.1's tolerance
fails the case naming the rows and heads. Skips, with the reason, where no real
kernel runs (no FlashMLA, another GPU)."""

from __future__ import annotations

import importlib.util

import pytest

from dcpcheck.impls.dsv41.kernels.corner_cases import corner_call, through_port_wrapper
from dcpcheck.impls.dsv41.kernels.selection import REFERENCE, KernelSelection

pytestmark = [pytest.mark.gpu, pytest.mark.world_sizes(1)]

CASES = [(heads, sink) for heads in (8, 64, 128) for sink in (False, True)]


def real_kernel_missing() -> str | None:
    if importlib.util.find_spec("flash_mla") is None:
        return "FlashMLA is not installed (tools/carry_flashmla.py install)"
    return None


def corners_through_the_adapter(ctx) -> list:
    """-> [(heads, sink, kernel or why not, worst out/tol, worst LSE/tol)] of each corner call."""
    selection = KernelSelection()
    results = []
    for heads, sink in CASES:
        call = corner_call(heads, sink=sink, device=ctx.device)
        kernel = selection.compute(*call.args())
        if kernel == REFERENCE:
            return [(heads, sink, selection.choose(call.query, call.swa_kv_cache, None, None)[2], None, None)]
        results.append((heads, sink, kernel, selection.last.worst_out, selection.last.worst_lse))
    return results


def corners_through_the_port(ctx):
    """-> (kernel or why not, worst) of the port's wrapper on the corner call, or why it cannot load."""
    from dcpcheck.impls.dsv41.tree.loading import PortSpec, PortSpecError, PortTree
    from dcpcheck.impls.vllm_adapter import VllmImplementation

    try:
        VllmImplementation()  # vLLM set up as --dcp-impl dsv41 sets it up (its compiled names' stand-ins)
        tree = PortTree(PortSpec())
    except PortSpecError as exc:
        return f"no DCP2 tree: {exc}", None
    call = corner_call(8, sink=True, device=ctx.device)
    through_port_wrapper(tree.module({}), call)
    last = tree.flashinfer.selection.last
    return (last.kernel, last.worst) if last else (tree.flashinfer.selection.describe(ctx.device), None)


def test_flashmla_agrees_with_the_reference_on_the_contracts_corners(dcp):
    missing = real_kernel_missing()
    if missing:
        pytest.skip(missing)
    (results,) = dcp.run(corners_through_the_adapter)
    if results[0][3] is None:
        pytest.skip(f"no real kernel computes here: {results[0][2]}")
    print(
        "\n".join(f"H={h} sink={s}: {k}, worst out {o:.3g}, LSE {lse:.3g} of tolerance" for h, s, k, o, lse in results)
    )
    assert len(results) == len(CASES)


def test_the_ports_wrapper_computes_with_flashmla(dcp):
    missing = real_kernel_missing() or (importlib.util.find_spec("vllm") is None and "vLLM is not installed")
    if missing:
        pytest.skip(missing)
    ((kernel, worst),) = dcp.run(corners_through_the_port)
    if worst is None:
        pytest.skip(f"the port's call is not computed by a real kernel here: {kernel}")
    print(f"the port's wrapper: {kernel}, worst {worst:.3g} of tolerance")
