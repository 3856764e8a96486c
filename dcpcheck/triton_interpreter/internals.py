"""The Triton internals the patches read, replace or call, each with the
parameters it had in the Triton versions the patches were checked on
(``triton/runtime/interpreter.py``, ``triton/language/core.py``,
``triton/language/standard.py`` of Triton 3.9.0).

:func:`differences` compares them with the installed Triton: a private
rename or a changed signature in a release leaves the interpreter as
shipped rather than patched wrongly.
"""

from __future__ import annotations

import importlib
import inspect

# "module:qualified.name" -> its parameters as written ("self, *args, **kwargs"),
# or None where only its presence is relied on.
TOUCHED = {
    # language_shortcut: the per-launch patch kept, its np dtypes and block types kept
    "triton.runtime.interpreter:_patch_lang": "fn",
    "triton.runtime.interpreter:_patch_lang_tensor": "tensor, scope",
    "triton.runtime.interpreter:_LangPatchScope.restore": "self",
    "triton.runtime.interpreter:_get_np_dtype": "tt_dtype",
    "triton.runtime.interpreter:InterpreterBuilder.get_block_ty": "self, dtype, shape",
    "triton.language.core:block_type.__init__": "self, element_ty, shape",
    "triton.language.core:block_type.with_element_ty": "self, scalar_ty",
    "triton.language.core:tensor.__init__": "self, handle, type",
    "triton.language.core:tuple.__init__": "self, args, type",
    "triton.language.core:pointer_type.__init__": "self, element_ty, address_space, const",
    "triton.language.core:tensor_descriptor_base": None,
    "triton.language.core:condition": None,
    "triton.language.core:is_builtin": "fn",
    # vectorised_launches: one run of a launch's body for all its programs
    "triton.runtime.interpreter:GridExecutor.__init__": "self, fn, arg_names, grid, pre_run_hooks",
    "triton.runtime.interpreter:GridExecutor.__call__": "self, *args_dev, **kwargs",
    "triton.runtime.interpreter:GridExecutor._init_args_hst": "self, args_dev, kwargs",
    "triton.runtime.interpreter:GridExecutor._restore_args_dev": "self, args_dev, args_hst, kwargs, kwargs_hst",
    "triton.runtime.interpreter:_implicit_cvt": "arg",
    "triton.runtime.interpreter:interpreter_builder": None,
    "triton.runtime.interpreter:InterpreterBuilder.set_grid_dim": "self, nx, ny, nz",
    "triton.runtime.interpreter:InterpreterBuilder.create_get_program_id": "self, axis",
    "triton.runtime.interpreter:InterpreterBuilder.create_splat": "self, ret_ty, arg",
    "triton.runtime.interpreter:InterpreterBuilder.create_broadcast": "self, arg, shape",
    "triton.runtime.interpreter:InterpreterBuilder.create_masked_load": "self, ptrs, mask, other, cache_policy, is_volatile",
    "triton.runtime.interpreter:InterpreterBuilder.create_masked_store": "self, ptrs, value, mask, cache_policy",
    "triton.runtime.interpreter:TensorHandle.__init__": "self, data, dtype, attr",
    "triton.runtime.interpreter:ReduceOps.__init__": "self, axis, combine_fn, keep_dims",
    "triton.runtime.interpreter:ReduceOps.apply_impl": "self, input",
    "triton.runtime.interpreter:ScanOps.apply_impl": "self, input",
    # the combine functions a reduction is recognised by (jitted: compared, never called)
    "triton.language.standard:_sum_combine": None,
    "triton.language.standard:_elementwise_max": None,
    "triton.language.standard:_elementwise_min": None,
}


def parameters(fn) -> str:
    """``fn``'s parameters as :data:`TOUCHED` writes them: names, ``*`` and ``**`` kept, annotations and defaults not."""
    prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return ", ".join(prefix.get(p.kind, "") + p.name for p in inspect.signature(fn).parameters.values())


def _find(path: str):
    module, _, qualname = path.partition(":")
    found = importlib.import_module(module)
    for name in qualname.split("."):
        found = getattr(found, name)
    return found


def differences(touched: dict[str, str | None] = TOUCHED) -> list[str]:
    """Each touched internal the installed Triton lacks or defines with other parameters, in words."""
    found = []
    for path, expected in touched.items():
        try:
            obj = _find(path)
        except (ImportError, AttributeError):
            found.append(f"{path} is missing")
            continue
        if expected is None:
            continue
        try:
            actual = parameters(obj)
        except (TypeError, ValueError):  # not a function any more
            actual = f"no signature ({type(obj).__name__})"
        if actual != expected:
            found.append(f"{path} takes ({actual}), not ({expected})")
    return found
