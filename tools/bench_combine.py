#!/usr/bin/env python3
"""Latency of an implementation's stage-3 combine beside the bare NCCL collectives it uses.

For decode shapes (T tokens, H gathered heads, D = 512, bf16 partials, fp32
LSE) on W GPUs, one rank per GPU, it times:

* ``ag_rs``: the combine of ``--dcp-impl`` (default: the embedded port), backend ag_rs; ``bare ag+rs``: what it moves,
  an all-gather of the LSEs [T, H] fp32 plus a reduce-scatter of the rescaled
  partial [H, T, D] fp32 (the port reduces in fp32);
* ``a2a``: that combine, backend a2a; ``bare a2a``: its all-to-all of
  [W, T, H/W, D + 2] bf16 (the LSE rides as two bf16 columns).

Each is timed eager and as one CUDA-graph replay (how decode runs), with CUDA
events around every call after a warm-up: the median over the calls, the
largest over the ranks. ``bound`` is the bytes each rank sends over the bus
bandwidth of a large all-gather measured first. The table is printed and
written as CSV and markdown.

    python tools/bench_combine.py --nproc 2 --out bench          # spawns its ranks
    python tools/bench_combine.py --nproc 2 --dcp-impl vllm      # another implementation's combine
    torchrun --nproc-per-node 2 tools/bench_combine.py --out bench
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dcpcheck.group import DcpGroup
from dcpcheck.impls.registry import load_implementation

HEAD_DIM = 512
LSE_COLUMNS = 2  # an fp32 LSE packed as bf16 columns
BANDWIDTH_PROBE_BYTES = 256 << 20


@dataclass
class Measurement:
    tokens: int
    heads: int
    op: str
    eager_us: float
    graph_us: float
    wire_bytes: int  # bytes one rank sends
    bound_us: float


def median_us(starts, ends) -> float:
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def time_calls(call, iters: int) -> float:
    """Median µs of ``call()`` timed one by one with CUDA events."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return median_us(starts, ends)


def time_eager(fn, *, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    return time_calls(fn, iters)


def time_graph(fn, *, warmup: int, iters: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles kernels and sets up communicators outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        for _ in range(warmup):
            graph.replay()
        torch.cuda.synchronize()
        dist.barrier()
        return time_calls(graph.replay, iters)
    finally:
        # destroy_process_group() hangs while a graph holding NCCL collectives lives.
        del graph
        torch.cuda.synchronize()


def bus_bandwidth(world: int, device) -> float:
    """Bytes/s one rank moves in a large all-gather (NCCL's bus bandwidth)."""
    chunk = torch.empty(BANDWIDTH_PROBE_BYTES // world, dtype=torch.uint8, device=device)
    gathered = torch.empty(BANDWIDTH_PROBE_BYTES, dtype=torch.uint8, device=device)
    seconds = time_eager(lambda: dist.all_gather_into_tensor(gathered, chunk), warmup=5, iters=20) * 1e-6
    return BANDWIDTH_PROBE_BYTES * (world - 1) / world / seconds


def shape_ops(combine, group: DcpGroup, tokens: int, heads: int, dtype: torch.dtype):
    """-> [(op, fn, wire bytes per rank)] for one (T, H)."""
    world, device = group.world_size, group.device
    gen = torch.Generator(device=device).manual_seed(tokens * 1000 + heads + group.rank_in_group)
    out = torch.randn(tokens, heads, HEAD_DIM, generator=gen, device=device).to(dtype)
    lse = torch.randn(tokens, heads, generator=gen, device=device) * 4.0
    lses = torch.empty(world * tokens * heads, dtype=torch.float32, device=device)
    scaled = torch.empty(heads * tokens * HEAD_DIM, dtype=torch.float32, device=device)
    reduced = torch.empty(heads * tokens * HEAD_DIM // world, dtype=torch.float32, device=device)
    packed = torch.empty(world * tokens * (heads // world) * (HEAD_DIM + LSE_COLUMNS), dtype=dtype, device=device)
    received = torch.empty_like(packed)
    share = (world - 1) / world  # what leaves a rank in a ring / pairwise collective

    def bare_ag_rs():
        dist.all_gather_into_tensor(lses, lse.view(-1))
        dist.reduce_scatter_tensor(reduced, scaled)

    ag_rs_bytes = int(share * (lses.numel() * 4 + scaled.numel() * 4))
    a2a_bytes = int(share * packed.numel() * packed.element_size())
    return [
        ("ag_rs", lambda: combine(out, lse, group, backend="ag_rs", return_lse=True), ag_rs_bytes),
        ("bare ag+rs", bare_ag_rs, ag_rs_bytes),
        ("a2a", lambda: combine(out, lse, group, backend="a2a", return_lse=True), a2a_bytes),
        ("bare a2a", lambda: dist.all_to_all_single(received, packed), a2a_bytes),
    ]


def largest_over_ranks(value: float, device) -> float:
    t = torch.tensor([value], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def run_benchmark(group: DcpGroup, args) -> list[Measurement]:
    combine = load_implementation(args.dcp_impl).combine
    device = group.device
    bandwidth = bus_bandwidth(group.world_size, device)
    if group.rank_in_group == 0:
        print(f"W={group.world_size}: all-gather bus bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    results = []
    for heads in args.heads:
        for tokens in args.tokens:
            for op, fn, wire_bytes in shape_ops(combine, group, tokens, heads, torch.bfloat16):
                eager = time_eager(fn, warmup=args.warmup, iters=args.iters)
                graph = time_graph(fn, warmup=args.warmup, iters=args.iters)
                results.append(Measurement(
                    tokens, heads, op, largest_over_ranks(eager, device), largest_over_ranks(graph, device),
                    wire_bytes, wire_bytes / bandwidth * 1e6,
                ))  # fmt: skip
    return results


# ---- the table ----------------------------------------------------------------

COLUMNS = ("T", "H", "op", "eager us", "graph us", "MB sent/rank", "bound us", "eager / bare", "graph / bare")
BARE_OF = {"ag_rs": "bare ag+rs", "a2a": "bare a2a"}


def table_rows(results: list[Measurement]) -> list[list[str]]:
    by_key = {(m.tokens, m.heads, m.op): m for m in results}
    rows = []
    for m in results:
        bare = by_key.get((m.tokens, m.heads, BARE_OF.get(m.op)))
        ratios = [f"{m.eager_us / bare.eager_us:.2f}", f"{m.graph_us / bare.graph_us:.2f}"] if bare else ["", ""]
        rows.append([
            str(m.tokens), str(m.heads), m.op, f"{m.eager_us:.1f}", f"{m.graph_us:.1f}",
            f"{m.wire_bytes / 1e6:.3f}", f"{m.bound_us:.1f}", *ratios,
        ])  # fmt: skip
    return rows


def write_tables(rows: list[list[str]], out: Path, world: int) -> str:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"bench_combine_w{world}.csv", "w", newline="") as fh:
        csv.writer(fh).writerows([COLUMNS, *rows])
    markdown = "\n".join(
        ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)] + ["| " + " | ".join(r) + " |" for r in rows]
    )
    (out / f"bench_combine_w{world}.md").write_text(markdown + "\n")
    return markdown


# ---- launching ----------------------------------------------------------------


def rank_main(rank: int, world: int, store_path: str | None, args) -> None:
    device = torch.device("cuda", rank if store_path else int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    store = dist.FileStore(store_path, world) if store_path else None
    dist.init_process_group(
        "nccl", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60), device_id=device
    )
    group = DcpGroup(rank, world, device, dist.group.WORLD, None)
    try:
        rows = table_rows(run_benchmark(group, args))
        if rank == 0:
            print(write_tables(rows, args.out, world), flush=True)
    finally:
        dist.destroy_process_group()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--nproc", type=int, default=None, help="ranks to spawn (default: every GPU); ignored under torchrun"
    )
    parser.add_argument("--dcp-impl", default="port", help="port | vllm | dsv41 | pkg.module:attr (its combine)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--heads", type=int, nargs="+", default=[64, 128], help="gathered heads H")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--iters", type=int, default=200, help="timed calls per measurement (the median is kept)")
    parser.add_argument(
        "--out", type=Path, default=Path("bench-combine"), help="folder for the CSV and markdown tables"
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, args)
        return 0
    world = args.nproc or torch.cuda.device_count()
    if world < 2 or world > torch.cuda.device_count():
        print(
            f"bench_combine: needs W >= 2 ranks, one GPU each; asked for {world}, "
            f"{torch.cuda.device_count()} GPUs visible",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-combine-") as tmp:
        torch.multiprocessing.spawn(rank_main, args=(world, os.path.join(tmp, "store"), args), nprocs=world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
