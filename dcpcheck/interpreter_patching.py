"""Under Triton's interpreter, patch ``triton.language`` once per launch, not again at each nested call.

Triton 3.9's interpreter (``TRITON_INTERPRET=1``) patches ``triton.language``
when a kernel launches and restores it when the launch ends. A nested
``@triton.jit`` call (a helper such as the port's ``owner_and_local``) runs the
same patching again while the launch's is still in place: it walks every
member of ``tl``, ``tl.tensor`` and ``tl.math``, finds each builtin already
wrapped, and re-sets the same closures, a scan costlier than most helpers'
bodies (``reports/cpu_profile.md``). :func:`patch_language_once_per_launch`
skips that second pass when the launch has already patched every language
module the callee sees; every other call goes through Triton's own code. What
a kernel computes does not change: ``tests/selftest/test_interpreter_patching.py``
compares every port kernel's outputs with and without it.

Only the Triton versions named in ``PATCHED_VERSIONS`` are patched, those whose
interpreter was read for this; under any other the interpreter runs as shipped.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

PATCHED_VERSIONS = ("3.9.",)


class _Launch(threading.local):
    """The language modules the running launch has patched; ``None`` outside a launch."""

    patched: frozenset | None = None


@dataclass
class Shortcut:
    """What :func:`patch_language_once_per_launch` replaced: put these back to run the interpreter as shipped."""

    launch_kernel: Callable  # triton.runtime.interpreter.GridExecutor.__call__
    patch_lang: Callable  # triton.runtime.interpreter._patch_lang


def _language_modules(fn, tl) -> frozenset:
    """The modules Triton's ``_patch_lang`` patches for ``fn``: ``tl`` and ``tl.core`` where its globals hold them."""
    return frozenset(
        id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core)
    )


def patch_language_once_per_launch() -> Shortcut | None:
    """Install the shortcut in this process (idempotent); -> what it replaced.

    ``None``, changing nothing, without ``TRITON_INTERPRET=1``, before anything
    imported triton, or under a Triton version not in ``PATCHED_VERSIONS``."""
    if os.environ.get("TRITON_INTERPRET") != "1" or "triton" not in sys.modules:
        return None  # nothing is interpreted, or nothing here imported triton (patching would import it)
    import triton

    if not triton.__version__.startswith(PATCHED_VERSIONS):
        return None
    import triton.language as tl
    from triton.runtime import interpreter

    installed = getattr(interpreter, "_dcpcheck_shortcut", None)
    if installed is not None:
        return installed
    shortcut = Shortcut(interpreter.GridExecutor.__call__, interpreter._patch_lang)
    launch = _Launch()

    def call_in_launch(self, *args, **kwargs):
        outer, launch.patched = launch.patched, frozenset()
        try:
            return shortcut.launch_kernel(self, *args, **kwargs)
        finally:
            launch.patched = outer

    def patch_lang_once(fn):
        modules = _language_modules(fn, tl)
        if launch.patched and modules <= launch.patched:
            return interpreter._LangPatchScope()  # already patched by this launch: nothing to set or restore
        scope = shortcut.patch_lang(fn)
        if launch.patched is not None:
            launch.patched |= modules
        return scope

    interpreter.GridExecutor.__call__ = call_in_launch
    interpreter._patch_lang = patch_lang_once
    interpreter._dcpcheck_shortcut = shortcut
    return shortcut
