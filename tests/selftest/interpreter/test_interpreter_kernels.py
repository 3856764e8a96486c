"""The port's Triton kernels under the installed Triton's interpreter, one of
each stage, on small inputs against the oracle (``port_kernel_checks.py``):
the CPU path runs on that interpreter, whose behaviour changes between
Triton releases (3.6's could not ``range()`` over a runtime scalar under
NumPy 2.4). Where this process compiles kernels for a GPU, each check runs in
a CPU-only subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dcpcheck.port.triton_env import INTERPRETED, TOKENS_PER_PROGRAM, TOPK_TILE, block_for
from tests.selftest.support.port_kernel_checks import CHECKS

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def interpreted_failures():
    """{stage: traceback or ""} from one CPU-only subprocess (one torch import
    for all stages); None where this process runs the interpreter itself."""
    if INTERPRETED:
        return None
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    code = "from tests.selftest.support.port_kernel_checks import run_checks; run_checks()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"the interpreter's checks did not run:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("stage", CHECKS)
def test_kernels_under_the_interpreter(stage, interpreted_failures):
    if interpreted_failures is None:
        CHECKS[stage]()
    else:
        assert not interpreted_failures[stage], (
            f"{stage} kernels under the Triton interpreter:\n{interpreted_failures[stage]}"
        )


@pytest.mark.parametrize("largest", [TOPK_TILE, TOKENS_PER_PROGRAM])
@pytest.mark.parametrize("extent", [1, 15, 16, 17, 100, 127, 128, 129, 255, 256, 257, 1000])
def test_a_launch_block_runs_as_many_programs_and_loop_steps_as_the_largest(extent, largest):
    """block_for shrinks a block only where one block of the largest size
    would hold the whole extent: the same programs, the same loop steps."""
    block = block_for(extent, largest)
    assert block & (block - 1) == 0 and block <= largest, f"block {block}: a power of two up to {largest}"
    assert -(-extent // block) == -(-extent // largest), f"extent {extent}: block {block} against {largest}"
    if not INTERPRETED:
        assert block == largest, "a GPU compiles one block size per kernel"
