"""dcpcheck's shortcut through Triton's interpreter (``dcpcheck/interpreter_patching.py``):
a launch patches ``triton.language`` once however many nested ``@triton.jit``
calls its kernel makes, and every port kernel's outputs are bitwise those of
the interpreter as shipped."""

from __future__ import annotations

import contextlib
from collections import Counter
from unittest import mock

import pytest
import torch
import triton

from dcpcheck.interpreter_patching import PATCHED_VERSIONS, patch_language_once_per_launch
from dcpcheck.port.triton_env import INTERPRETED
from dcpcheck.ranks.input_guard import as_bits
from tests.selftest.test_interpreter_kernels import CHECKS, check_stage1

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="needs this process to run the kernels under the interpreter")


@pytest.fixture
def shortcut():
    installed = patch_language_once_per_launch()
    if installed is None:
        pytest.skip(
            f"triton {triton.__version__}'s interpreter runs as shipped: PATCHED_VERSIONS is {PATCHED_VERSIONS}"
        )
    return installed


@contextlib.contextmanager
def as_shipped(shortcut):
    from triton.runtime import interpreter

    with (
        mock.patch.object(interpreter.GridExecutor, "__call__", shortcut.launch_kernel),
        mock.patch.object(interpreter, "_patch_lang", shortcut.patch_lang),
    ):
        yield


def _patched_for(owner, name: str, run) -> Counter:
    """How often ``run()`` has Triton patch the language for each function: the
    calls of Triton's own ``_patch_lang``, held as ``owner.<name>``."""
    with mock.patch.object(owner, name, wraps=getattr(owner, name)) as patch_lang:
        run()
    return Counter(f"{call.args[0].__module__}.{call.args[0].__name__}" for call in patch_lang.call_args_list)


def test_a_port_helper_called_in_a_launch_does_not_patch_the_language_again(shortcut):
    """Stage 1's kernels call ``_locate_state``, which calls ``owner_and_local``, once per top-k tile."""
    helpers = {"dcpcheck.port.index._locate_state", "dcpcheck.port.ownership.owner_and_local"}
    kernels = {"dcpcheck.port.index._filter_index_kernel": 1, "dcpcheck.port.index._slot_mapping_kernel": 1}
    from triton.runtime import interpreter

    with as_shipped(shortcut):
        shipped = _patched_for(interpreter, "_patch_lang", check_stage1)
    assert all(shipped[helper] > 1 for helper in helpers), f"as shipped: {dict(shipped)}"
    patched = _patched_for(shortcut, "patch_lang", check_stage1)
    assert {name: count for name, count in patched.items() if name.startswith("dcpcheck.")} == kernels, (
        f"with the shortcut: {dict(patched)}"
    )


@pytest.mark.parametrize("stage", CHECKS)
def test_outputs_are_bitwise_those_of_the_interpreter_as_shipped(stage, shortcut):
    outputs = CHECKS[stage]()
    with as_shipped(shortcut):
        shipped = CHECKS[stage]()
    for index, (got, expected) in enumerate(zip(outputs, shipped, strict=True)):
        assert torch.equal(as_bits(got), as_bits(expected)), (
            f"{stage} output {index} differs from the interpreter as shipped"
        )
