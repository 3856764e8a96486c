"""One GPU: a combine's local work beside the HBM bound, for any implementation.

Without a second GPU the collectives cannot be timed, but what a backend does
around them can: its combine runs for W simulated ranks with every collective
stubbed (each returns a buffer of the right shape, allocated once, and moves
nothing), so the time left is the pack, rescale and unpack-and-sum. Beside it,
a device-to-device copy of the partial's bytes (out + LSE): the least any
backend must move through HBM. Eager and CUDA-graph replay, median over calls.

    python tools/bench_local.py --dcp-impl port vllm --world-sizes 2 4 8 --out reports

Several implementations go in one table, one row per implementation and
shape, each beside the same copy.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from itertools import product
from pathlib import Path

import torch
import torch.distributed as dist
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_combine import time_calls  # this script's folder is on sys.path

from dcpcheck.impls.registry import load_implementation

HEAD_DIM = 512


class StubGroup:
    """The GroupCoordinator surface of rank 0 of W, with collectives that move nothing."""

    def __init__(self, world_size: int, device: torch.device):
        self.world_size, self.rank_in_group, self.device = world_size, 0, device
        self.device_group = self.cpu_group = None
        self._buffers: dict[tuple, torch.Tensor] = {}

    def _buffer(self, shape, dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        if key not in self._buffers:
            self._buffers[key] = torch.zeros(shape, dtype=dtype, device=self.device)
        return self._buffers[key]

    def all_gather(self, tensor, dim=-1):
        shape = list(tensor.shape)
        shape[dim] *= self.world_size
        return self._buffer(shape, tensor.dtype)

    def reduce_scatter(self, tensor, dim=-1):
        shape = list(tensor.shape)
        shape[dim] //= self.world_size
        return self._buffer(shape, tensor.dtype)

    def all_reduce(self, tensor):
        return tensor

    def broadcast(self, tensor, src=0):
        return tensor


class _Done:
    """The work handle of a collective that already finished (vLLM's a2a waits on one)."""

    def wait(self):
        return True


@contextmanager
def no_all_to_all():
    """``torch.distributed.all_to_all_single`` as a no-op (the a2a backends call it directly)."""
    saved = dist.all_to_all_single
    dist.all_to_all_single = lambda output, input, *args, **kwargs: _Done()
    try:
        yield
    finally:
        dist.all_to_all_single = saved


def time_us(fn, *, warmup: int, iters: int, graph: bool) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if not graph:
        return time_calls(fn, iters)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        fn()
    return time_calls(cuda_graph.replay, iters)


def measure(impls: dict, args) -> list[list[str]]:
    device = torch.device("cuda", 0)
    rows = []
    for world in args.world_sizes:
        group = StubGroup(world, device)
        for heads in args.heads:
            for tokens in args.tokens:
                gen = torch.Generator(device=device).manual_seed(tokens * 1000 + heads)
                out = torch.randn(tokens, heads, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16)
                lse = torch.randn(tokens, heads, generator=gen, device=device) * 4.0
                nbytes = out.numel() * out.element_size() + lse.numel() * lse.element_size()
                source = torch.empty(nbytes, dtype=torch.uint8, device=device)
                target = torch.empty_like(source)
                copy = {
                    g: time_us(lambda t=target, s=source: t.copy_(s), warmup=args.warmup, iters=args.iters, graph=g)
                    for g in (False, True)
                }
                for (name, impl), backend in product(impls.items(), args.backends):

                    def call(impl=impl, out=out, lse=lse, group=group, backend=backend):
                        return impl.combine(out, lse, group, backend=backend, return_lse=True)

                    with no_all_to_all():
                        local = {g: time_us(call, warmup=args.warmup, iters=args.iters, graph=g) for g in (False, True)}
                    rows.append([
                        name, str(world), str(tokens), str(heads), backend, f"{local[False]:.1f}",
                        f"{local[True]:.1f}", f"{copy[True]:.1f}", f"{local[True] / copy[True]:.2f}",
                    ])  # fmt: skip
    return rows


COLUMNS = ("impl", "W", "T", "H", "backend", "local eager us", "local graph us", "copy graph us", "graph / copy")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dcp-impl", nargs="+", default=["port"], help="port | vllm | dsv41 | pkg.module:attr (their combines)"
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--heads", type=int, nargs="+", default=[64, 128], help="gathered heads H")
    parser.add_argument("--backends", nargs="+", default=["ag_rs", "a2a"])
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--out", type=Path, default=None, help="write the table as markdown here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_local: needs a GPU (it times CUDA kernels)", file=sys.stderr)
        return 2
    impls = {spec: load_implementation(spec) for spec in args.dcp_impl}
    for spec, impl in impls.items():
        if not callable(getattr(impl, "combine", None)):
            print(f"bench_local: --dcp-impl {spec} has no combine", file=sys.stderr)
            return 2
    rows = measure(impls, args)
    table = "\n".join(
        ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)] + ["| " + " | ".join(r) + " |" for r in rows]
    )
    described = "; ".join(f"{spec}: {impl.describe()}" for spec, impl in impls.items() if hasattr(impl, "describe"))
    header = (
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}, "
        f"median of {args.iters} calls after {args.warmup} warm-ups; {described or 'no header of the implementations'}"
    )
    print(f"{header}\n{table}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "_".join(spec.replace(":", "_").replace("/", "_") for spec in args.dcp_impl)
        (args.out / f"bench_local_{name}.md").write_text(f"{header}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
