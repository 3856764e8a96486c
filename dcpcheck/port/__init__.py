"""The embedded reference DCP2 port: Triton kernels and torch."""

from . import triton_env  # noqa: F401  (must precede any triton import)
