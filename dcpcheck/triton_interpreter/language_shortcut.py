"""Under Triton's interpreter, patch ``triton.language`` once per process, not at every launch and nested call.

Triton 3.9's interpreter (``TRITON_INTERPRET=1``) patches ``triton.language``
when a kernel launches, restores it when the launch ends, and patches again at
every nested ``@triton.jit`` call (a port helper, or Triton's own ``tl.sum``,
``tl.max``, ``tl.cumsum``, ``tl.zeros``): each pass walks every member of
``tl``, ``tl.tensor`` and ``tl.math`` (``reports/cpu_profile.md``). The patch
is the same every time: the builtins wrapped to run on the interpreter's one
builder, Python stand-ins for ``range``, ``reduce`` and the like.
:func:`install` has Triton's own ``_patch_lang`` patch
both ``tl`` and ``tl.core`` at the process's first launch and keeps that patch
for the life of the process: later launches and nested calls patch nothing and
restore nothing. What a kernel computes does not change:
``tests/selftest/interpreter/test_interpreter_patching.py`` compares every port kernel's
outputs with those of the interpreter as shipped (:meth:`Shortcut.shipped`).

After the first launch ``triton.language`` stays patched outside launches too.
Nothing compiles under ``TRITON_INTERPRET=1``, and outside kernels neither
dcpcheck nor the vLLM code it imports calls more of ``tl`` than
``tl.constexpr``, which is not patched (Triton as shipped also leaves
``tl.core`` patched once a nested call of its standard library has run). A
kept patch is also safe between threads, where per-launch restores are not: a
launch ending in one thread (a case thread of ``dcpcheck.ranks.torchrun`` left
running at its timeout) could unpatch the language under a launch in another.

The shortcut also answers the interpreter's ``_get_np_dtype`` (called at every
cast, splat, load and store) from a table kept per Triton type: as shipped it
builds its whole 18-entry table at each call. Each answer is the shipped
function's own, asked once per type.

Block types are kept too, one per element type and shape
(:class:`BlockTypes`): as shipped, every op's result builds a new
``tl.block_type`` (its shape validated, its name formatted) and a
``tl.tensor`` whose shape is rebuilt as a tuple of ``tl.constexpr``, a
quarter of a small kernel's launch. The interpreter's builder
(``InterpreterBuilder.get_block_ty``) and ``block_type.with_element_ty`` answer
from the table, and a tensor of a kept type, or of a scalar type, takes its
shape and numel without building them.

Installed by :func:`dcpcheck.triton_interpreter.install`, which decides
whether this Triton is patched at all.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


class _NothingToRestore:
    """What a launch gets instead of a ``_LangPatchScope``: the language stays patched after it."""

    def restore(self) -> None:
        pass


_NOTHING_TO_RESTORE = _NothingToRestore()


class BlockTypes:
    """``tl.block_type`` objects kept per (element type, shape), each with the
    shape and numel a ``tl.tensor`` of it holds, built as shipped once. A shape
    of anything but ints and ``tl.constexpr``, or an element type that cannot
    be a key, gets a type built as shipped, not kept."""

    def __init__(self):
        self.table: dict = {}

    def of(self, element_ty, shape):
        import triton.language as tl

        dims = tuple(dim.value if isinstance(dim, tl.constexpr) else dim for dim in shape)
        if not all(type(dim) is int for dim in dims):
            return tl.block_type(element_ty, shape)
        try:
            key = (_type_key(element_ty), dims)
            kept = self.table.get(key)
        except TypeError:  # unhashable: a type the key does not know
            return tl.block_type(element_ty, shape)
        if kept is None:
            kept = tl.block_type(element_ty, list(dims))  # raises as shipped for a bad shape: nothing kept
            # As tl.tensor builds it: Triton's own tuple of tl.constexpr.
            kept._dcpcheck_tensor_shape = tl.core.tuple([tl.constexpr(dim) for dim in kept.shape])
            kept._dcpcheck_numel = tl.constexpr(math.prod(kept.shape))
            self.table[key] = kept
        return kept

    def entry_points(self) -> dict[tuple[object, str], tuple[Callable, Callable]]:
        """(owner, attribute) -> (as shipped, answering from the table), for
        ``InterpreterBuilder.get_block_ty``, ``block_type.with_element_ty`` and ``tensor.__init__``."""
        import triton.language as tl
        from triton.runtime import interpreter

        def get_block_ty(builder, dtype, shape):
            return self.of(dtype, shape)

        def with_element_ty(block_ty, scalar_ty):
            return self.of(scalar_ty, block_ty.shape)

        shipped_tensor_init = tl.core.tensor.__init__
        scalar_numel, scalar_shape = tl.constexpr(1), tl.core.tuple([])

        def tensor_init(tensor, handle, type):
            shape = getattr(type, "_dcpcheck_tensor_shape", None)
            if shape is not None:
                tensor.handle, tensor.type, tensor.dtype = handle, type, type.element_ty
                tensor.numel, tensor.shape = type._dcpcheck_numel, shape
            elif isinstance(type, tl.dtype) and not type.is_block():  # a scalar: its own scalar type
                tensor.handle, tensor.type, tensor.dtype = handle, type, type
                tensor.numel, tensor.shape = scalar_numel, scalar_shape
            else:  # a block type built elsewhere
                shipped_tensor_init(tensor, handle, type)

        ours = {
            (interpreter.InterpreterBuilder, "get_block_ty"): get_block_ty,
            (tl.core.block_type, "with_element_ty"): with_element_ty,
            (tl.core.tensor, "__init__"): tensor_init,
        }
        return {(owner, name): (getattr(owner, name), fn) for (owner, name), fn in ours.items()}


def _type_key(ty):
    """A hashable key equal for equal Triton types: a pointer type (unhashable) by its fields."""
    import triton.language as tl

    if isinstance(ty, tl.pointer_type):
        return ("pointer", _type_key(ty.element_ty), ty.address_space, ty.const)
    hash(ty)
    return ty


@dataclass
class Shortcut:
    """What :func:`install` replaced, and the patch it keeps."""

    patch_lang: Callable  # triton.runtime.interpreter._patch_lang as shipped
    get_np_dtype: Callable  # triton.runtime.interpreter._get_np_dtype as shipped
    # (owner, attribute) -> (as shipped, the shortcut's): the block-type table's entry points
    block_type_entries: dict = field(repr=False)
    kept: object | None = None  # the process's patch (Triton's _LangPatchScope) once a launch made it
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    seen: set = field(default_factory=set, repr=False)  # functions found to see triton.language

    def patch(self) -> None:
        """Patch ``tl`` and ``tl.core`` with Triton's own ``_patch_lang``, unless done already."""
        with self.lock:
            if self.kept is None:
                import triton.language as tl

                # _patch_lang reads only its argument's globals: one holding both
                # modules gets both patched, tl first, as a launch and then a
                # nested call of Triton's standard library would.
                both = {"tl": tl, "core": tl.core}
                self.kept = self.patch_lang(
                    types.SimpleNamespace(__module__=__name__, __name__="tl_and_tl_core", __globals__=both)
                )

    @contextlib.contextmanager
    def shipped(self) -> Iterator[None]:
        """Run the interpreter as shipped: the kept patch undone, every launch and
        nested call patching again; afterwards the language as it was before the
        kept patch (what the shipped run left patched undone too), and the next
        launch patches it again."""
        import triton.language as tl
        from triton.runtime import interpreter

        with self.lock:
            if self.kept is not None:
                self.kept.restore()
                self.kept = None
            # Everything Triton's _patch_lang sets attributes on.
            targets = (tl, tl.core, tl.math, tl.tensor, tl.dtype, tl.condition, tl.core.tensor_descriptor_base)
            unpatched = [(obj, dict(vars(obj))) for obj in targets]
            installed = interpreter._patch_lang, interpreter._get_np_dtype
            interpreter._patch_lang, interpreter._get_np_dtype = self.patch_lang, self.get_np_dtype
            for (owner, name), (shipped, _) in self.block_type_entries.items():
                setattr(owner, name, shipped)
        try:
            yield
        finally:
            with self.lock:
                interpreter._patch_lang, interpreter._get_np_dtype = installed
                for (owner, name), (_, ours) in self.block_type_entries.items():
                    setattr(owner, name, ours)
                for obj, attributes in unpatched:
                    for name in vars(obj).keys() - attributes.keys():
                        delattr(obj, name)
                    for name, value in attributes.items():
                        if vars(obj).get(name) is not value:
                            setattr(obj, name, value)


def _sees_language(fn) -> bool:
    """The check Triton's ``_patch_lang`` makes of a function: its globals hold ``tl`` or ``tl.core``."""
    import triton.language as tl

    return any(inspect.ismodule(value) and value in (tl, tl.core) for value in fn.__globals__.values())


def _np_dtype_per_type(get_np_dtype: Callable) -> Callable:
    """``get_np_dtype`` asked once per scalar type (a block's is its element's):
    its answers kept in a table. Pointer types, which are not hashable, it
    answers at once without its table."""
    import triton.language as tl

    table: dict = {}

    def np_dtype_of(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return get_np_dtype(scalar)
        found = table.get(scalar)
        if found is None:
            found = table[scalar] = get_np_dtype(scalar)
        return found

    return np_dtype_of


def install(interpreter) -> Shortcut:
    """Install the shortcut in ``interpreter`` (``triton.runtime.interpreter``;
    idempotent) -> what it replaced. The language itself is patched at the
    first launch after this."""
    installed = getattr(interpreter, "_dcpcheck_shortcut", None)
    if installed is not None:
        return installed
    shortcut = Shortcut(interpreter._patch_lang, interpreter._get_np_dtype, BlockTypes().entry_points())

    def keep_lang_patched(fn):
        # Triton's check, once per function, with Triton's message.
        if fn not in shortcut.seen:
            assert _sees_language(fn), "triton.language must be visible from within jit'd function"
            shortcut.seen.add(fn)
        if shortcut.kept is None:
            shortcut.patch()
        return _NOTHING_TO_RESTORE

    interpreter._patch_lang = keep_lang_patched
    interpreter._get_np_dtype = _np_dtype_per_type(shortcut.get_np_dtype)
    for (owner, name), (_, ours) in shortcut.block_type_entries.items():
        setattr(owner, name, ours)
    interpreter._dcpcheck_shortcut = shortcut
    return shortcut
