"""The port's one ownership formula, shared by every kernel that locates a state.

State ``c`` lives on rank ``(c // S) % W`` at index ``(c // (S*W)) * S + c % S``
among that rank's states (S = interleave). Written independently of the
suite's oracle: the port and its reference must not share it.
"""

from __future__ import annotations

import triton
import triton.language as tl  # noqa: F401  (the interpreter requires it in a jit function's module)

from . import triton_env  # noqa: F401  (first: sets TRITON_INTERPRET before triton loads)


@triton.jit
def owner_and_local(state, world_size, interleave):
    """-> (owning rank, index among that rank's states) of compressed ``state``."""
    owner = (state // interleave) % world_size
    local = (state // (interleave * world_size)) * interleave + state % interleave
    return owner, local
