"""Seconds this process spent compiling Triton kernels, or loading them from
Triton's on-disk cache: the "compile" phase of tools/gpu_ci.py's breakdown.

Triton's JIT calls ``jit_cache_hook`` before it compiles a kernel that this
process has not compiled yet, and ``jit_post_compile_hook`` after; the clock
sums the time between. Triton releases without ``triton.knobs`` (before 3.4)
are not timed."""

from __future__ import annotations

import time

_clock = {"started": None, "seconds": 0.0, "installed": False}


def _before_compile(**_):
    _clock["started"] = time.perf_counter()
    return None  # falsy: Triton goes on and compiles


def _after_compile(**_):
    if _clock["started"] is not None:
        _clock["seconds"] += time.perf_counter() - _clock["started"]
        _clock["started"] = None


def install() -> None:
    """Start timing compiles (once; leaves hooks someone else set alone)."""
    if _clock["installed"]:
        return
    _clock["installed"] = True
    import triton

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or runtime.jit_cache_hook is not None or runtime.jit_post_compile_hook is not None:
        return
    runtime.jit_cache_hook = _before_compile
    runtime.jit_post_compile_hook = _after_compile


def seconds() -> float:
    return _clock["seconds"]
