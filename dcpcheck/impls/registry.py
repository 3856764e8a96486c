"""Resolve ``--dcp-impl`` to the implementation object under test.

Accepted values: a built-in name (``port``, ``vllm``), ``pkg.module:attr``,
or ``path/to/file.py:attr``. ``attr`` names an implementation object, or a
class / zero-argument factory that returns one.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
import traceback
from functools import cache
from pathlib import Path

from dcpcheck.impls.load_watchdog import killed_past
from dcpcheck.impls.protocol import CAPABILITIES


class ImplSpecError(ValueError):
    """``--dcp-impl`` names nothing the suite can load."""


def _embedded_port():
    from dcpcheck.port.impl import EmbeddedPort

    return EmbeddedPort()


def _vllm_tree():
    from dcpcheck.impls.vllm_adapter import VllmImplementation

    return VllmImplementation()


def _dsv41_tree(spec: str):
    from dcpcheck.impls.dsv41.implementation import Dsv41Implementation, PortSpecError

    try:
        return Dsv41Implementation(spec)
    except PortSpecError as exc:
        raise ImplSpecError(f"--dcp-impl {spec}: {' '.join(str(exc).split())}") from None


BUILTIN = {"port": _embedded_port, "vllm": _vllm_tree}
INSTALL_HINT = (
    "install it (vLLM on CPU: tools/install_vllm_cpu.sh .venv; for dsv41 also PYTHONPATH=build/dsv41-tree, "
    "from tools/build_dsv41_tree.sh; on a GPU host: tools/carry_vllm.py)"
)

ACCEPTED = (
    "'port' (the embedded reference port), 'vllm' (an installed vLLM tree's DCP primitives), "
    "'dsv41' or 'dsv41:MODULE:CLASS' (a vLLM tree's DCP2 DeepSeek-V4.1 attention layer; '@bfloat16' after "
    "either: bf16 caches instead of fp8_ds_mla), "
    "'pkg.module:attr' or 'path/to/file.py:attr' (your own implementation)"
)


def _one_line(exc: BaseException) -> str:
    """``ExcType: message`` on one line (a usage error is one line)."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a hostile __str__ must not turn a usage error into a crash
        message = "<str() of the exception raised>"
    return " ".join(f"{type(exc).__name__}: {message}".split())


def _import_file(path: Path):
    name = "dcpcheck_user_impl_" + str(abs(hash(str(path.resolve()))))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]  # a half-executed module must not be found by the next load
        raise
    return module


def _import_target(spec: str, target: str):
    """The module ``target`` names; anything it raises while importing is a usage error."""
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ImplSpecError(f"--dcp-impl {spec!r}: no such file {target!r}; accepted: {ACCEPTED}")
    try:
        return _import_file(path) if target.endswith(".py") else importlib.import_module(target)
    except ImportError as exc:
        raise ImplSpecError(
            f"--dcp-impl {spec!r}: cannot import module {target!r} ({_one_line(exc)}); accepted: {ACCEPTED}"
        ) from exc
    except KeyboardInterrupt:
        raise  # a Ctrl-C stays one
    except (
        BaseException
    ) as exc:  # a broken module (a syntax error, raising or sys.exit() at import) is the user's input
        raise ImplSpecError(
            f"--dcp-impl {spec!r}: importing {target!r} raised {_one_line(exc)}; fix it, or pick another "
            f"implementation; accepted: {ACCEPTED}"
        ) from exc


def _resolve_attr(spec: str):
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ImplSpecError(f"--dcp-impl {spec!r} is not recognised; accepted: {ACCEPTED}")
    module = _import_target(spec, target)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImplSpecError(f"--dcp-impl {spec!r}: module {target!r} has no attribute {attr!r}") from None


def _built_in(spec: str, build):
    """A built-in implementation; a module it needs that is missing or fails to import is a usage error."""
    try:
        return build()
    except ImportError as exc:
        raise ImplSpecError(
            f"--dcp-impl {spec}: a module it needs is missing or does not import ({_one_line(exc)}); "
            f"{INSTALL_HINT}, or pick another implementation; accepted: {ACCEPTED}"
        ) from exc
    except (KeyboardInterrupt, ImplSpecError):
        raise
    except BaseException as exc:  # its tree's code (a sys.exit() at import) is the user's input
        raise ImplSpecError(f"--dcp-impl {spec}: building it raised {_one_line(exc)}; accepted: {ACCEPTED}") from exc


@cache
def load_implementation(spec: str):
    """The implementation object for ``spec`` (cached per process)."""
    return _load(spec)


USAGE_ERROR_EXIT = 4  # pytest's exit code for a usage error
STACK_FRAMES_SHOWN = 8


# Past the deadline thread's, the watchdog process's: it acts only when the
# thread could not (the loading thread never lets Python run again).
WATCHDOG_GRACE_S = 2.0


def load_implementation_within(spec: str, seconds: float, inspect=None):
    """:func:`load_implementation`, then ``inspect(impl)`` when given (reading
    its attributes runs its code), bounded like a pool's start
    (``--dcp-startup-timeout``) -> (the implementation, what ``inspect``
    returned). It loads in this thread (an import may set signal handlers,
    which only the main thread can); one that has not returned by then (a
    tree whose ``vllm/__init__.py`` waits forever) ends the process with a
    one-line usage error naming where it is stuck: a stuck import cannot be
    abandoned, and nothing may wait for it. One that never lets Python run
    again (spinning in C with the GIL held) is killed by a watchdog process
    :data:`WATCHDOG_GRACE_S` later, with the same first line."""
    loaded = threading.Event()
    loader = threading.get_ident()
    threading.Thread(
        target=_exit_unless_loaded, args=(spec, seconds, loaded, loader), name="dcpcheck-load-deadline", daemon=True
    ).start()
    held_gil = (
        f"ERROR: --dcp-impl {spec}: loading it did not end within {seconds:g} s (--dcp-startup-timeout): it never "
        "let Python run again (stuck in C code holding the GIL, which no thread of its process can interrupt), "
        "so a watchdog process killed it (SIGKILL); its Python stacks follow\n"
    )
    try:
        with killed_past(seconds + WATCHDOG_GRACE_S, held_gil):
            impl = load_implementation(spec)
            return impl, inspect(impl) if inspect is not None else None
    finally:
        loaded.set()


def _exit_unless_loaded(spec: str, seconds: float, loaded: threading.Event, loader: int) -> None:
    if loaded.wait(seconds):
        return
    message = _stuck_loading(spec, seconds, sys._current_frames()[loader])
    if loaded.is_set():  # it returned as the deadline passed
        return
    sys.stderr.write(f"ERROR: {message}\n")  # as pytest writes a usage error
    sys.stderr.flush()
    os._exit(USAGE_ERROR_EXIT)


def _stuck_loading(spec: str, seconds: float, frame) -> str:
    """Which module the loader is importing (the innermost module body on its stack), and its stack."""
    stack = [line for line in traceback.extract_stack(frame) if not line.filename.startswith("<frozen")]
    module = frame
    while module is not None and module.f_code.co_name != "<module>":
        module = module.f_back
    where = f"importing module {module.f_globals.get('__name__')!r}" if module is not None else "after its imports"
    shown = "; ".join(
        f"{line.filename}:{line.lineno} in {line.name}: {line.line}" for line in reversed(stack[-STACK_FRAMES_SHOWN:])
    )
    return (
        f"--dcp-impl {spec}: loading it did not end within {seconds:g} s (--dcp-startup-timeout): stuck {where}; "
        f"its stack, innermost first: {shown}"
    )


def _load(spec: str):
    if spec in BUILTIN:
        return _built_in(spec, BUILTIN[spec])
    if spec == "dsv41" or spec.startswith(("dsv41:", "dsv41@")):
        return _built_in(spec, lambda: _dsv41_tree(spec))
    if ":" not in spec:
        raise ImplSpecError(f"--dcp-impl {spec!r} is not recognised; accepted: {ACCEPTED}")
    found = _resolve_attr(spec)
    if isinstance(found, type) or (callable(found) and not _looks_like_impl(found)):
        try:
            impl = found()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # a constructor that raises (or calls sys.exit()) is a broken --dcp-impl
            raise ImplSpecError(
                f"--dcp-impl {spec!r}: calling {getattr(found, '__name__', repr(found))}() "
                f"raised {_one_line(exc)}; it must build the implementation with no arguments"
            ) from exc
    else:
        impl = found
    if not _looks_like_impl(impl):
        raise ImplSpecError(
            f"--dcp-impl {spec!r} resolved to {impl!r}, which has none of the capability methods {sorted(CAPABILITIES)}"
        )
    return impl


def _looks_like_impl(obj) -> bool:
    return any(callable(getattr(obj, name, None)) for name in CAPABILITIES)


def missing_capabilities(impl, needed) -> list[str]:
    return [name for name in needed if not callable(getattr(impl, name, None))]
