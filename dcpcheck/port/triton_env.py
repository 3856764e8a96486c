"""Choose how the port's Triton kernels run before triton is first imported.

Without a GPU the kernels run under the Triton interpreter, which reads
``TRITON_INTERPRET`` once, at import: setting it later has no effect.
"""

from __future__ import annotations

import os
import sys


def wants_interpreter() -> bool:
    import torch

    return not torch.cuda.is_available()


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
