"""dcpcheck's patches of Triton's interpreter (``TRITON_INTERPRET=1``), for speed only: what a kernel computes does not change.

What is patched, once :func:`install` runs in a process:

- :mod:`.language_shortcut`: ``triton.language`` patched once per process,
  not at every launch and nested ``@triton.jit`` call; the interpreter's
  ``_get_np_dtype`` answered per type; block types kept per element type and shape.
- :mod:`.vectorised_launches`: the kernels in ``VECTORISED_KERNELS`` run once
  per launch for all their programs, checked against the shipped run at each
  specialisation's first launch.

:func:`install` is called wherever a process loads an implementation to run
(the pytest process at configure, the zygote server ranks fork from, a rank
at its case; after the load, since the patches need triton imported). It
leaves the interpreter as shipped, and :meth:`Installation.header_line` says
why, where ``DCPCHECK_TRITON_AS_SHIPPED=1`` asks for it, where Triton is not
a version in ``PINNED_VERSIONS`` (those the patches were checked on), or
where an internal the patches touch is missing or takes other parameters
(:mod:`.internals`). A specialisation the vectoriser cannot run alike falls
back to the shipped run on its own (``Vectoriser.fallbacks``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from dcpcheck.triton_interpreter import internals, language_shortcut, vectorised_launches
from dcpcheck.triton_interpreter.language_shortcut import Shortcut
from dcpcheck.triton_interpreter.vectorised_launches import VECTORISED_KERNELS, Vectoriser

# The Triton releases whose interpreter the patches were read against and
# tests/selftest/interpreter/test_interpreter_patching.py passed under.
PINNED_VERSIONS = ("3.9.0",)
AS_SHIPPED_ENV = "DCPCHECK_TRITON_AS_SHIPPED"
PATCHED = "triton.language patched once per process, np dtypes and block types kept per type"


@dataclass(frozen=True)
class Installation:
    """What :func:`install` did in this process."""

    as_shipped: str | None  # why nothing is patched; None where both patches are installed
    shortcut: Shortcut | None = None
    vectoriser: Vectoriser | None = None

    def header_line(self, fallbacks: Iterable[str] = ()) -> str:
        """The run header's one line on Triton's interpreter, with the ranks' :func:`fallbacks`."""
        if self.as_shipped is not None:
            return f"Triton interpreter: as shipped, nothing patched: {self.as_shipped}"
        by_module: dict[str, list[str]] = {}
        for kernel in sorted(self.vectoriser.kernels):
            module, _, name = kernel.rpartition(".")
            by_module.setdefault(module, []).append(name)
        vectorised = "; ".join(f"{', '.join(names)} ({module})" for module, names in by_module.items())
        return (
            f"Triton interpreter: triton {_version()} patched (dcpcheck/triton_interpreter): {PATCHED} | "
            f"vectorised: {vectorised}, each specialisation checked against the shipped run at its first launch | "
            f"fallbacks: {'; '.join(fallbacks) or 'none'} ({AS_SHIPPED_ENV}=1 runs it all as shipped)"
        )


_installed: Installation | None = None  # once triton is imported under the interpreter, the answer stays


def fallbacks() -> tuple[str, ...]:
    """This process's vectorised kernel specialisations sent back to the shipped run, each ``kernel: why``."""
    vectoriser = _installed.vectoriser if _installed is not None else None
    if vectoriser is None:
        return ()
    return tuple(sorted({f"{name.rpartition('.')[2]}: {why}" for (name, _), why in list(vectoriser.fallbacks.items())}))


def as_shipped_requested() -> bool:
    """Whether ``DCPCHECK_TRITON_AS_SHIPPED`` asks for the interpreter as shipped; raises ValueError for a bad value."""
    value = os.environ.get(AS_SHIPPED_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(
            f"{AS_SHIPPED_ENV}={value!r} is not accepted: 1 runs Triton's interpreter as shipped; 0 or unset patches it"
        )
    return value == "1"


def install() -> Installation:
    """Install both patches in this process where they apply (idempotent) -> what was done, and why not."""
    global _installed
    if _installed is not None:
        return _installed
    if os.environ.get("TRITON_INTERPRET") != "1":
        return Installation("not in use (TRITON_INTERPRET is not 1: kernels are compiled)")
    if "triton" not in sys.modules:  # importing it here would cost an implementation that never uses it
        return Installation("triton is not imported")
    _installed = _decide()
    return _installed


def _version() -> str:
    import triton

    return triton.__version__


def _decide() -> Installation:
    if as_shipped_requested():
        return Installation(f"{AS_SHIPPED_ENV}=1")
    if _version() not in PINNED_VERSIONS:
        pinned = ", ".join(PINNED_VERSIONS)
        return Installation(f"triton {_version()} is not a version the patches were checked on ({pinned})")
    differences = internals.differences()
    if differences:
        return Installation(
            f"triton {_version()}'s internals differ from those the patches touch: {'; '.join(differences)}"
        )
    from triton.runtime import interpreter

    return Installation(None, language_shortcut.install(interpreter), vectorised_launches.install(interpreter))


__all__ = [
    "AS_SHIPPED_ENV",
    "PINNED_VERSIONS",
    "VECTORISED_KERNELS",
    "Installation",
    "as_shipped_requested",
    "fallbacks",
    "install",
]
