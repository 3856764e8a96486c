"""Under Triton's interpreter, run all programs of a listed vLLM kernel's launch in one pass.

Triton's interpreter runs a launch's body once per program, and every op of
it through Triton's semantic layer: tens of microseconds an op, however small
the block. vLLM's DCP all-to-all kernels (``vllm/v1/attention/ops/dcp.py``:
``_dcp_a2a_pack_send_kernel``, ``_dcp_a2a_unpack_combine_kernel``) launch one
program per (token, local head), each a few dozen small ops, and took most of
a ``--dcp-impl dsv41`` case's time on CPU (``tools/cpu_profile.py``).

A vectorised launch runs the body once, with ``tl.program_id`` a column of
every program's id: each op then acts on every program's values at once
(numpy broadcasting over a leading program axis), and the programs advance
in lockstep, statement by statement, where the interpreter as shipped runs
them one after another. On a GPU they run at once in no set order, so a
kernel whose result depends on that order has a race either way.

Guards, so that what a kernel computes does not change:

- Only kernels named in ``VECTORISED_KERNELS`` (read for this: no branch or
  loop on a runtime value, each program writes its own slice), and only the
  interpreter's elementwise ops plus those adapted here (program id, splat,
  broadcast, load, store, and the sum, max and min reductions); any other op
  raises :class:`NotVectorisable`.
- The first launch of each specialisation (kernel, constexpr values, tensor
  dtypes) in a process also runs as shipped from the same inputs, and the
  memory both leave is compared bit for bit. A difference, or any exception
  of the vectorised run, puts that specialisation back on the shipped path
  for the life of the process (``Vectoriser.fallbacks`` says why), with the
  shipped run's result.
- Each later vectorised launch keeps a copy of its tensor arguments; an
  exception restores them and the launch, and every later one of its
  specialisation, runs as shipped.

Installed with the language shortcut (:mod:`.language_shortcut`) by
:func:`dcpcheck.triton_interpreter.install`; ``tests/selftest/interpreter/test_interpreter_grids.py``
checks both guards and, where vLLM imports, each listed kernel against the
interpreter as shipped.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

VECTORISED_KERNELS = (
    "vllm.v1.attention.ops.dcp._dcp_a2a_pack_send_kernel",
    "vllm.v1.attention.ops.dcp._dcp_a2a_unpack_combine_kernel",
)

# The interpreter builder's ops that act element by element on numpy arrays
# of any shape (triton/runtime/interpreter.py, InterpreterBuilder): with a
# leading program axis they compute each program's values as the shipped
# per-program run does.
ELEMENTWISE_OPS = frozenset(
    {
        *(f"create_{op}" for op in ("si_to_fp", "ui_to_fp", "fp_to_si", "fp_to_ui", "fp_ext", "fp_trunc")),
        *(f"create_{op}" for op in ("int_cast", "fp_to_fp", "bitcast", "int_to_ptr", "ptr_to_int", "addptr")),
        *(f"create_{op}" for op in ("fadd", "fmul", "fdiv", "frem", "fsub", "fneg", "mul", "precise_divf")),
        *(f"create_{op}" for op in ("approx_divf", "sdiv", "udiv", "srem", "urem", "add", "sub", "idiv")),
        *(f"create_{op}" for op in ("shl", "lshr", "ashr", "and", "xor", "or", "umulhi", "clampf", "select")),
        *(f"create_{op}" for op in ("minsi", "minui", "minimumf", "minnumf", "maxsi", "maxui", "maximumf")),
        *(f"create_{op}" for op in ("maxnumf", "fma", "fabs", "iabs", "floor", "ceil", "precise_sqrt", "sqrt")),
        *(f"create_{op}" for op in ("exp", "exp2", "log", "log2", "cos", "sin", "erf", "rsqrt")),
        *(f"create_icmp{cmp}" for cmp in ("EQ", "NE", "SGE", "SGT", "SLE", "SLT", "UGE", "UGT", "ULE", "ULT")),
        *(f"create_fcmp{o}{cmp}" for o in "OU" for cmp in ("EQ", "NE", "GE", "GT", "LE", "LT")),
        "create_get_num_programs",
        "create_make_range",
        "create_load",
        "create_store",
        "create_barrier",
    }
)
ADAPTED_OPS = ("create_get_program_id", "create_splat", "create_broadcast", "create_masked_load", "create_masked_store")


class NotVectorisable(Exception):
    """The vectorised run reached an op it cannot run for every program at once."""


_running = threading.local()  # .program_ids: this thread's vectorised launch's ids, one column per grid axis


def _program_ids():
    return getattr(_running, "program_ids", None)


@dataclass
class Vectoriser:
    """What :func:`install` installed, and what it learnt."""

    shipped_call: object  # GridExecutor.__call__ as shipped
    kernels: frozenset[str]  # module.qualname of each kernel run vectorised
    ops: _VectorisedOps  # the interpreter's ops for a vectorised run, in place only while one runs
    verified: set = field(default_factory=set)  # specialisations whose first launch matched the shipped run
    fallbacks: dict = field(default_factory=dict)  # specialisation -> why it runs as shipped
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def call(self, executor, *args, **kwargs) -> None:
        name = f"{executor.fn.__module__}.{executor.fn.__qualname__}"
        if name not in self.kernels:
            return self.shipped_call(executor, *args, **kwargs)
        key = (name, _specialisation(executor, args, kwargs))
        if key in self.fallbacks:
            return self.shipped_call(executor, *args, **kwargs)
        memory = _Memory.of(args, kwargs)
        if key not in self.verified:
            return self._first_launch(key, memory, executor, args, kwargs)
        try:
            self._vectorised_call(executor, args, kwargs)
        except Exception as exc:  # noqa: BLE001  (whatever it was, the shipped run decides: it raises a real error)
            memory.restore(memory.before)
            self._fall_back(key, f"{type(exc).__name__}: {exc}")
            self.shipped_call(executor, *args, **kwargs)

    def _first_launch(self, key, memory: _Memory, executor, args, kwargs) -> None:
        self.shipped_call(executor, *args, **kwargs)
        shipped = memory.copy()
        memory.restore(memory.before)
        try:
            self._vectorised_call(executor, args, kwargs)
        except Exception as exc:  # noqa: BLE001  (the shipped run, done first, decided the launch)
            memory.restore(shipped)
            return self._fall_back(key, f"{type(exc).__name__}: {exc}")
        if not memory.equals(shipped):
            memory.restore(shipped)
            return self._fall_back(key, "its memory differed from the shipped run's after its first launch")
        with self.lock:
            self.verified.add(key)

    def _vectorised_call(self, executor, args, kwargs) -> None:
        with self.ops.in_place():
            _vectorised_call(executor, args, kwargs)

    def _fall_back(self, key, why: str) -> None:
        with self.lock:
            self.fallbacks[key] = why


@dataclass
class _VectorisedOps:
    """The interpreter's attributes a vectorised run replaces (adapted, or
    refused), each ``(owner, name, shipped, replacement)``. They are in place
    only while some thread runs a vectorised launch: every other op of every
    other kernel then runs as shipped, without a wrapper's cost. A thread that
    runs a shipped launch meanwhile gets the shipped op through the
    replacement (it checks for this thread's vectorised run)."""

    patches: list
    runs: int = 0  # vectorised launches running now, over every thread
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @contextlib.contextmanager
    def in_place(self) -> Iterator[None]:
        with self.lock:
            if self.runs == 0:
                for owner, name, _, replacement in self.patches:
                    setattr(owner, name, replacement)
            self.runs += 1
        try:
            yield
        finally:
            with self.lock:
                self.runs -= 1
                if self.runs == 0:
                    for owner, name, shipped, _ in self.patches:
                        setattr(owner, name, shipped)


@dataclass
class _Memory:
    """The storages a launch's tensor arguments view, and a copy of them from before it."""

    storages: list
    before: list

    @classmethod
    def of(cls, args, kwargs) -> _Memory:
        import torch

        seen, storages = set(), []
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in seen:
                seen.add(value.untyped_storage().data_ptr())
                storages.append(torch.empty(0, dtype=torch.uint8, device=value.device).set_(value.untyped_storage()))
        return cls(storages, [bytes_.clone() for bytes_ in storages])

    def copy(self) -> list:
        return [bytes_.clone() for bytes_ in self.storages]

    def restore(self, saved: list) -> None:
        for bytes_, kept in zip(self.storages, saved):
            bytes_.copy_(kept)

    def equals(self, saved: list) -> bool:
        import torch

        return all(torch.equal(bytes_, kept) for bytes_, kept in zip(self.storages, saved))


def _specialisation(executor, args, kwargs) -> tuple:
    """What picks a launch's code: its constexpr values and its tensors' dtypes."""
    import torch

    bound = inspect.getcallargs(executor.fn, *args, **kwargs)
    constexprs = tuple((name, repr(bound[name])) for name in executor.constexprs if name in bound)
    dtypes = tuple(str(value.dtype) for value in bound.values() if isinstance(value, torch.Tensor))
    return constexprs, dtypes


def _vectorised_call(executor, args_dev, kwargs) -> None:
    """``GridExecutor.__call__`` as shipped (triton/runtime/interpreter.py), its per-program loop replaced by one run."""
    import numpy as np
    from triton.runtime import interpreter

    argspec = inspect.getfullargspec(executor.fn)
    kwargs = {k: v for k, v in kwargs.items() if k in argspec.args or k in argspec.kwonlyargs}
    args_hst, kwargs_hst = executor._init_args_hst(args_dev, kwargs)
    for hook in executor.pre_run_hooks:
        hook(*args_hst, **kwargs_hst)
    patch_scope = interpreter._patch_lang(executor.fn)
    try:
        args = inspect.getcallargs(executor.fn, *args_hst, **kwargs_hst)
        args = {name: a if name in executor.constexprs else interpreter._implicit_cvt(a) for name, a in args.items()}
        grid = executor.grid(args) if callable(executor.grid) else executor.grid
        grid = tuple(grid) + (1,) * (3 - len(grid))
        interpreter.interpreter_builder.set_grid_dim(*grid)
        # x slowest, z fastest: the shipped loops' order, so that a store's lanes land in program order.
        ids = np.meshgrid(*(np.arange(n, dtype=np.int32) for n in grid), indexing="ij")
        _running.program_ids = tuple(axis.reshape(-1, 1) for axis in ids)
        try:
            with _one_python_value_for_every_program():
                executor.fn(**args)
        finally:
            _running.program_ids = None
    finally:
        patch_scope.restore()
    executor._restore_args_dev(args_dev, args_hst, kwargs, kwargs_hst)


@contextlib.contextmanager
def _one_python_value_for_every_program() -> Iterator[None]:
    """A tensor's ``__bool__`` and ``__index__`` (a branch or loop on a
    runtime value, or a check of Triton's semantic layer) where the tensor
    holds every program's values: their common value, the same for each
    program, else refused. As shipped, ``__bool__`` answers True for any
    tensor of more than one element, which would take a branch for every
    program."""
    import math

    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    tensor = tl.core.tensor
    patched = {name: vars(tensor)[name] for name in ("__bool__", "__index__")}

    def common_value(name):
        def method(self):
            data = self.handle.data
            numel = math.prod(self.type.shape) if isinstance(self.type, tl.block_type) else 1
            if _program_ids() is None or data.size == numel:
                return patched[name](self)
            per_program = data.reshape(data.shape[0], -1)
            if not (per_program == per_program[:1]).all():
                raise NotVectorisable(f"a tensor's {name} differing between programs (a branch on a runtime value)")
            return patched[name](tl.core.tensor(TensorHandle(data[0], self.handle.dtype), self.type))

        return method

    for name in patched:
        setattr(tensor, name, common_value(name))
    try:
        yield
    finally:
        for name, method in patched.items():
            setattr(tensor, name, method)


def _adapted_ops(shipped: dict) -> dict:
    """The builder ops whose shipped form assumes one program's shapes, each
    adapted to a leading program axis (and as shipped outside a vectorised run)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle, _get_np_dtype

    def create_get_program_id(self, axis):
        ids = _program_ids()
        return shipped["create_get_program_id"](self, axis) if ids is None else TensorHandle(ids[axis], tl.int32)

    def create_splat(self, ret_ty, arg):
        if _program_ids() is None or arg.data.size == 1:
            return shipped["create_splat"](self, ret_ty, arg)
        shape = (arg.data.shape[0], *ret_ty.shape)  # a scalar of each program: (programs, 1)
        return TensorHandle(np.broadcast_to(arg.data, shape).astype(_get_np_dtype(arg.dtype)), arg.dtype.scalar)

    def create_broadcast(self, arg, shape):
        if _program_ids() is None or arg.data.ndim <= len(shape):
            return shipped["create_broadcast"](self, arg, shape)
        return TensorHandle(np.broadcast_to(arg.data, (arg.data.shape[0], *shape)), arg.dtype.scalar)

    def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        if _program_ids() is not None:
            ptrs, mask, other = _broadcast_handles(ptrs, mask, other)
        return shipped["create_masked_load"](self, ptrs, mask, other, cache_policy, is_volatile)

    def create_masked_store(self, ptrs, value, mask, cache_policy):
        if _program_ids() is not None:
            ptrs, value, mask = _broadcast_handles(ptrs, value, mask)
        return shipped["create_masked_store"](self, ptrs, value, mask, cache_policy)

    adapted = (create_get_program_id, create_splat, create_broadcast, create_masked_load, create_masked_store)
    return {op.__name__: op for op in adapted}


def _broadcast_handles(*handles):
    """The handles' data broadcast to one shape, contiguous (the interpreter's load and store read it flat)."""
    import numpy as np
    from triton.runtime.interpreter import TensorHandle

    present = [handle for handle in handles if handle is not None]
    shape = np.broadcast_shapes(*(handle.data.shape for handle in present))
    return tuple(
        None
        if handle is None
        else TensorHandle(np.ascontiguousarray(np.broadcast_to(handle.data, shape)), handle.dtype)
        for handle in handles
    )


def _refused(name: str, shipped):
    def op(self, *args, **kwargs):
        if _program_ids() is not None:
            raise NotVectorisable(f"the interpreter's {name} is not run for all programs at once")
        return shipped(self, *args, **kwargs)

    return op


def _vectorised_reduce(shipped):
    """``ReduceOps.apply_impl`` with a leading program axis: sum, max and min along an axis one further in."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle, _get_np_dtype

    reductions = {
        tl.standard._sum_combine: np.sum,
        tl.standard._elementwise_max: np.nanmax,
        tl.standard._elementwise_min: np.nanmin,
    }

    def apply_impl(self, input):
        batched = [arg for arg in input if arg.handle.data.ndim > max(len(arg.shape), 1)]
        if _program_ids() is None or not batched:
            return shipped(self, input)
        reduce = reductions.get(self.combine_fn)
        if len(input) != 1 or reduce is None or self.axis is None:
            raise NotVectorisable(f"a reduction by {getattr(self.combine_fn, '__name__', self.combine_fn)}")
        arg = input[0]
        axis = self.axis % len(arg.shape)
        shape = list(arg.shape)
        if self.keep_dims:
            shape[axis] = 1
        else:
            del shape[axis]
        data = reduce(arg.handle.data, axis=axis + 1, keepdims=self.keep_dims)
        data = data.astype(_get_np_dtype(arg.dtype)).reshape(data.shape[0], *(shape or [1]))
        ret_type = tl.block_type(arg.dtype.scalar, shape) if shape else arg.dtype.scalar
        return tl.core.tensor(TensorHandle(data, arg.dtype.scalar), ret_type)

    return apply_impl


def install(interpreter, kernels: tuple[str, ...] = VECTORISED_KERNELS) -> Vectoriser:
    """Install vectorised launches for ``kernels`` in ``interpreter`` (``triton.runtime.interpreter``;
    idempotent) -> what was installed."""
    installed = getattr(interpreter, "_dcpcheck_vectoriser", None)
    if installed is not None:
        return installed
    builder = interpreter.InterpreterBuilder
    ops = [name for name in dir(builder) if name.startswith("create_")]
    shipped = {name: getattr(builder, name) for name in ops}
    replacements = {
        **{name: _refused(name, shipped[name]) for name in set(ops) - ELEMENTWISE_OPS - set(ADAPTED_OPS)},
        **_adapted_ops(shipped),
    }
    patches = [(builder, name, shipped[name], op) for name, op in replacements.items()]
    reduce, scan = interpreter.ReduceOps.apply_impl, interpreter.ScanOps.apply_impl
    patches.append((interpreter.ReduceOps, "apply_impl", reduce, _vectorised_reduce(reduce)))
    patches.append((interpreter.ScanOps, "apply_impl", scan, _refused("scan", scan)))
    vectoriser = Vectoriser(interpreter.GridExecutor.__call__, frozenset(kernels), _VectorisedOps(patches))

    def call(executor, *args, **kwargs):
        return vectoriser.call(executor, *args, **kwargs)

    interpreter.GridExecutor.__call__ = call
    interpreter._dcpcheck_vectoriser = vectoriser
    return vectoriser
