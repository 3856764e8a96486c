"""dcpcheck's shortcut through Triton's interpreter (``dcpcheck/triton_interpreter/language_shortcut.py``):
``triton.language`` is patched once per process, at its first launch, and kept
patched; no later launch or nested ``@triton.jit`` call patches or restores it,
and every port kernel's outputs are bitwise those of the interpreter as shipped."""

from __future__ import annotations

from collections import Counter
from unittest import mock

import pytest
import torch
import triton.language as tl

from dcpcheck.port.triton_env import INTERPRETED
from dcpcheck.ranks.input_guard import as_bits
from tests.selftest.support.interpreter_installation import installed_where_patched
from tests.selftest.support.port_kernel_checks import CHECKS, check_stage1

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="needs this process to run the kernels under the interpreter")


@pytest.fixture
def shortcut():
    return installed_where_patched("shortcut")


def _language_patching(owner, name: str, run) -> tuple[list, int]:
    """What ``run()`` has Triton do to the language: the functions its own
    ``_patch_lang`` (held as ``owner.<name>``) patched it for, and how often
    its ``_LangPatchScope.restore`` put it back."""
    from triton.runtime import interpreter

    scope = interpreter._LangPatchScope
    with (
        mock.patch.object(owner, name, wraps=getattr(owner, name)) as patch_lang,
        mock.patch.object(scope, "restore", autospec=True, side_effect=scope.restore) as restore,
    ):
        run()
    return [
        f"{call.args[0].__module__}.{call.args[0].__name__}" for call in patch_lang.call_args_list
    ], restore.call_count


def _is_patched() -> dict[str, bool]:
    """Whether ``tl`` and ``tl.core`` hold the interpreter's wrappers of their builtins."""
    return {"tl": not tl.core.is_builtin(tl.load), "tl.core": not tl.core.is_builtin(tl.core.load)}


def test_the_language_is_patched_once_per_process_not_per_launch_or_helper_call(shortcut):
    """Stage 1's kernels call ``_locate_state``, which calls ``owner_and_local``,
    and Triton's ``tl.cumsum`` and ``tl.sum`` once per top-k tile."""
    helpers = {"dcpcheck.port.index._locate_state", "dcpcheck.port.ownership.owner_and_local"}
    helpers |= {"triton.language.standard.cumsum", "triton.language.standard.sum"}
    kernels = {"dcpcheck.port.index._filter_index_kernel": 1, "dcpcheck.port.index._slot_mapping_kernel": 1}
    from triton.runtime import interpreter

    check_stage1()
    assert _is_patched() == {"tl": True, "tl.core": True}, "the shortcut's launches left the language unpatched"
    with shortcut.shipped():
        assert _is_patched()["tl"] is False, "as shipped, tl is patched before any launch"
        patched, restored = _language_patching(interpreter, "_patch_lang", check_stage1)
    shipped = Counter(patched)
    assert all(shipped[helper] > 1 for helper in helpers), f"as shipped: {dict(shipped)}"
    assert {kernel: shipped[kernel] for kernel in kernels} == kernels, f"as shipped: {dict(shipped)}"
    assert restored == sum(kernels.values()), "as shipped, each launch restores the language"

    # shipped() undid the kept patch: the next launch patches tl and tl.core, once.
    patched, restored = _language_patching(shortcut, "patch_lang", check_stage1)
    assert (len(patched), restored) == (1, 0), f"the first launch: {patched}, {restored} restores"
    assert _is_patched() == {"tl": True, "tl.core": True}
    patched, restored = _language_patching(shortcut, "patch_lang", check_stage1)
    assert (patched, restored) == ([], 0), "after the first launch, a stage-1 run patched or restored the language"
    assert _is_patched() == {"tl": True, "tl.core": True}


@pytest.mark.parametrize("stage", CHECKS)
def test_outputs_are_bitwise_those_of_the_interpreter_as_shipped(stage, shortcut):
    outputs = CHECKS[stage]()
    with shortcut.shipped():
        shipped = CHECKS[stage]()
    for index, (got, expected) in enumerate(zip(outputs, shipped, strict=True)):
        assert torch.equal(as_bits(got), as_bits(expected)), (
            f"{stage} output {index} differs from the interpreter as shipped"
        )


def test_np_dtypes_are_the_shipped_answers(shortcut):
    """The kept table answers as the shipped ``_get_np_dtype`` does, for every
    scalar, pointer and block type; ``shipped()`` runs the shipped function."""
    from triton.runtime import interpreter

    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64]
    scalars += [tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e4nv]
    pointers = [tl.pointer_type(tl.float32), tl.pointer_type(tl.bfloat16)]
    every = scalars + pointers + [tl.block_type(ty, [4, 2]) for ty in scalars + pointers]
    assert interpreter._get_np_dtype is not shortcut.get_np_dtype, "the shortcut left _get_np_dtype as shipped"
    for ty in every * 2:  # asked again: the kept answer
        assert interpreter._get_np_dtype(ty) == shortcut.get_np_dtype(ty), f"{ty}"
    with shortcut.shipped():
        assert interpreter._get_np_dtype is shortcut.get_np_dtype


def test_block_types_are_kept_per_element_type_and_shape(shortcut):
    """One block type per (element type, shape), pointers too, equal to the one
    built as shipped; a tensor of it, or of a scalar type, has the shipped
    tensor's shape, numel and dtype; ``shipped()`` builds a new type at every call again."""
    block = tl.block_type(tl.float32, [4, 2])
    for element in (tl.int32, tl.pointer_type(tl.bfloat16)):
        kept = block.with_element_ty(element)
        assert kept is block.with_element_ty(element) and kept == tl.block_type(element, [4, 2]), element
        ours, shipped = tl.tensor(None, kept), tl.tensor(None, tl.block_type(element, [4, 2]))
        assert (ours.shape, ours.numel, ours.dtype) == (shipped.shape, shipped.numel, shipped.dtype), element
        assert type(ours.shape) is type(shipped.shape) and all(isinstance(dim, tl.constexpr) for dim in ours.shape)
    for scalar in (tl.int32, tl.pointer_type(tl.float32)):
        ours = tl.tensor(None, scalar)
        with shortcut.shipped():
            shipped = tl.tensor(None, scalar)
        assert (ours.shape, ours.numel, ours.dtype, ours.type) == (shipped.shape, shipped.numel, shipped.dtype, scalar)
        assert type(ours.shape) is type(shipped.shape), scalar
    with shortcut.shipped():
        assert block.with_element_ty(tl.int32) is not block.with_element_ty(tl.int32)
    assert block.with_element_ty(tl.int32) is block.with_element_ty(tl.int32), "shipped() left the table unused"
