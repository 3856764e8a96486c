"""How the port's Triton kernels run: chosen once, before triton is imported.

Without a GPU the kernels run under the Triton interpreter, which reads
``TRITON_INTERPRET`` once, at import: setting it later has no effect. The
interpreter pays about 1 ms per program instance, so it gets large blocks; a
GPU gets blocks that fit in registers. Every launch size of the port lives
here, next to the decision it depends on.

Under the interpreter every op also costs more the larger its block, masked
lanes included, so :func:`block_for` shrinks a block to the launch's extent:
the same programs and loop steps as the largest block, without the padding.
A GPU keeps one block size per kernel, so that it compiles one variant.

Kernels loop over a runtime bound (top-k) with ``while``, not ``range()``:
the interpreter hands a kernel its scalars as 1-element arrays, and Triton
3.6's interpreter turns one into a ``range()`` bound with ``int()``, which
NumPy 2.4 refuses (``only 0-dimensional arrays can be converted``); a
``while`` test goes through ``bool()``, which every Triton admitted here
accepts. ``tests/selftest/interpreter/test_interpreter_kernels.py`` runs each kernel
under the interpreter.
"""

from __future__ import annotations

import os
import sys


def wants_interpreter() -> bool:
    import torch

    # device_count asks NVML: a process that imported the port can still fork
    # ranks that use the GPU (is_available initialises CUDA's driver).
    return torch.cuda.device_count() == 0


def ensure_triton_mode() -> None:
    """Set ``TRITON_INTERPRET=1`` when there is no GPU; refuse if too late."""
    if not wants_interpreter() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:
        raise RuntimeError(
            "triton was imported before dcpcheck could set TRITON_INTERPRET=1 "
            "for this CPU-only process; export TRITON_INTERPRET=1 before "
            "starting Python (or import dcpcheck.port first)"
        )
    os.environ["TRITON_INTERPRET"] = "1"


ensure_triton_mode()

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

TOPK_TILE = 128  # top-k entries per loop step of the index kernels
TOKENS_PER_PROGRAM = 256 if INTERPRETED else 16  # rows per program of the index kernels
POSITIONS_PER_PROGRAM = 4096 if INTERPRETED else 1024  # positions per program of the write side
COMBINE_TILE_ELEMENTS = (1 << 19) if INTERPRETED else (1 << 12)  # elements of a combine program's widest tile
MIN_BLOCK = 16  # the smallest block block_for gives
# Rows per block of sparse_attention (torch): bounds its fp32 temporaries on a
# GPU; small under the interpreter so that the test shapes cross blocks too.
ATTENTION_TOKENS_PER_BLOCK = 32 if INTERPRETED else 1024


def block_for(extent: int, largest: int) -> int:
    """Block size over ``extent`` items, for a kernel whose block holds at most
    ``largest``: ``largest`` on a GPU; under the interpreter the smallest power of
    two (at least MIN_BLOCK) that covers ``extent``, up to ``largest``."""
    if not INTERPRETED:
        return largest
    import triton  # here, not at the top: this module runs before triton's import

    return min(largest, max(MIN_BLOCK, triton.next_power_of_2(extent)))
