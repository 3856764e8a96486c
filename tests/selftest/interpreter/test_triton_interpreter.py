"""Where and when dcpcheck patches Triton's interpreter (``dcpcheck/triton_interpreter``):
in the pytest process and every rank under a pinned Triton; as shipped, said in
one header line and never a usage error, where an internal it touches was
renamed or ``DCPCHECK_TRITON_AS_SHIPPED=1`` asks for it."""

from __future__ import annotations

import json

import pytest
import triton

from dcpcheck.triton_interpreter import AS_SHIPPED_ENV, PINNED_VERSIONS
from tests.selftest.support.inner import inner_env, run_inner_pytest, run_python_module, write_session

pytestmark = [
    pytest.mark.spawned_only,
    pytest.mark.skipif(
        triton.__version__ not in PINNED_VERSIONS, reason=f"triton {triton.__version__} is not pinned: nothing to patch"
    ),
]

# A rank function that fails unless its process's interpreter is patched as
# EXPECT_PATCHED says (1: both patches installed; 0: as shipped).
RANK_STATE_TESTS = """
import os

import pytest

pytestmark = [pytest.mark.world_sizes(2), pytest.mark.stage(1)]


def interpreter_state(ctx):
    from triton.runtime import interpreter

    from dcpcheck import triton_interpreter

    patched = [hasattr(interpreter, f"_dcpcheck_{name}") for name in ("shortcut", "vectoriser")]
    want = os.environ["EXPECT_PATCHED"] == "1"
    assert patched == [want, want], f"rank {ctx.rank}: patched {patched}, expected {want}"
    assert (triton_interpreter.install().as_shipped is None) == want, triton_interpreter.install().header_line()


def test_each_rank(dcp):
    dcp.run(interpreter_state)
"""

# A kernel whose programs read each other's writes, vectorised in the rank:
# its first launch differs from the shipped run's, and falls back.
FALLBACK_TESTS = """
import pytest
import torch
import triton
import triton.language as tl

pytestmark = [pytest.mark.world_sizes(1), pytest.mark.stage(1)]


@triton.jit
def _running_count(out_ptr):
    i = tl.program_id(0) + tl.arange(0, 1)
    tl.store(out_ptr + i, tl.load(out_ptr + i - 1, mask=i > 0, other=0) + 1)


def launch_listed(ctx):
    from dcpcheck import triton_interpreter

    vectoriser = triton_interpreter.install().vectoriser
    vectoriser.kernels |= {f"{_running_count.fn.__module__}.{_running_count.fn.__qualname__}"}
    out = torch.zeros(4, dtype=torch.int32)
    _running_count[(4,)](out)
    assert out.tolist() == [1, 2, 3, 4]


def test_fallback(dcp):
    dcp.run(launch_listed)
"""

# triton.runtime.interpreter with one internal the patches touch renamed, as a release might.
RENAMED = """
import json
import sys

from triton.runtime import interpreter

shipped = interpreter._patch_lang, interpreter.GridExecutor.__call__
interpreter.InterpreterBuilder.get_block_type = interpreter.InterpreterBuilder.get_block_ty
del interpreter.InterpreterBuilder.get_block_ty
"""

RENAMED_PROBE = (
    RENAMED
    + """
from dcpcheck import triton_interpreter

installed = triton_interpreter.install()
now = interpreter._patch_lang, interpreter.GridExecutor.__call__
print(json.dumps({"header": installed.header_line(), "untouched": now == shipped}))
"""
)

HEADER_PREFIX = "Triton interpreter: "


def _header_line(output: str) -> str:
    (line,) = [line for line in output.splitlines() if line.startswith(HEADER_PREFIX)]
    return line


def test_the_pytest_process_and_every_rank_run_the_patched_interpreter(tmp_path):
    write_session(tmp_path, {"test_state.py": RANK_STATE_TESTS})
    code, output = run_inner_pytest(tmp_path, ["test_state.py", "--world-sizes", "2"], EXPECT_PATCHED="1")
    assert code == 0 and "1 passed" in output, output
    header = _header_line(output)
    assert header.startswith(f"Triton interpreter: triton {triton.__version__} patched"), header
    assert "vectorised: _dcp_a2a_pack_send_kernel, _dcp_a2a_unpack_combine_kernel" in header, header


def test_the_opt_out_runs_every_process_as_shipped(tmp_path):
    write_session(tmp_path, {"test_state.py": RANK_STATE_TESTS})
    code, output = run_inner_pytest(
        tmp_path, ["test_state.py", "--world-sizes", "2"], EXPECT_PATCHED="0", **{AS_SHIPPED_ENV: "1"}
    )
    assert code == 0 and "1 passed" in output, output
    assert _header_line(output) == f"Triton interpreter: as shipped, nothing patched: {AS_SHIPPED_ENV}=1", output


def test_a_bad_opt_out_value_is_a_usage_error(tmp_path):
    write_session(tmp_path, {"test_state.py": RANK_STATE_TESTS})
    code, output = run_inner_pytest(tmp_path, ["test_state.py"], EXPECT_PATCHED="0", **{AS_SHIPPED_ENV: "yes"})
    assert code == 4, output
    assert f"ERROR: {AS_SHIPPED_ENV}='yes' is not accepted: 1 runs Triton's interpreter as shipped" in output, output


def test_a_renamed_internal_leaves_the_interpreter_as_shipped_and_says_so(tmp_path):
    (tmp_path / "renamed_probe.py").write_text(RENAMED_PROBE)
    code, output = run_python_module(tmp_path, "renamed_probe", [], env=inner_env(TRITON_INTERPRET="1"), timeout=120)
    assert code == 0, output
    probe = json.loads(output.splitlines()[-1])
    assert probe["untouched"], f"the interpreter was patched though an internal it touches was renamed: {output}"
    assert probe["header"] == (
        f"Triton interpreter: as shipped, nothing patched: triton {triton.__version__}'s internals differ from "
        "those the patches touch: triton.runtime.interpreter:InterpreterBuilder.get_block_ty is missing"
    ), probe


def test_a_renamed_internal_is_no_usage_error(tmp_path):
    """The session runs its cases, its header saying the interpreter runs as shipped."""
    write_session(tmp_path, {"test_state.py": RANK_STATE_TESTS})
    conftest = tmp_path / "conftest.py"
    conftest.write_text(RENAMED + conftest.read_text())
    code, output = run_inner_pytest(tmp_path, ["test_state.py", "--world-sizes", "2"], EXPECT_PATCHED="1")
    assert code == 0 and "1 passed" in output, output  # the ranks (no conftest of theirs) are patched
    assert "InterpreterBuilder.get_block_ty is missing" in _header_line(output), output


def test_a_kernel_sent_back_to_the_shipped_run_is_named_in_the_header(tmp_path):
    write_session(tmp_path, {"test_fallback.py": FALLBACK_TESTS})
    code, output = run_inner_pytest(tmp_path, ["test_fallback.py", "--world-sizes", "1"])
    assert code == 0 and "1 passed" in output, output
    fallback = "_running_count: its memory differed from the shipped run's after its first launch"
    assert f"fallbacks: {fallback} ({AS_SHIPPED_ENV}=1" in _header_line(output), output
