"""``--dcp-impl vllm`` and ``dsv41`` on a broken or partial vLLM install:
every missing dependency and every module raising at import is a usage
error (exit 4, one line naming the module), and the stand-ins for vLLM's
compiled extensions are installed only where those are absent, and declared.

A fake vLLM tree first on the path stands in for the real one (CI runs the
self-tests before vLLM is installed); its DCP module imports what vLLM's
modules import on CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.selftest.support.inner import inner_env, run_sessions_in_one_interpreter, write_session
from tests.selftest.support.session_sources import MULTI_RANK_TESTS

pytestmark = pytest.mark.spawned_only

# What importing vLLM's DCP modules reaches on CUDA (vllm/platforms/cuda.py,
# w8a8_utils.py, vllm_flash_attn/__init__.py).
CUDA_IMPORTS = """
import torch
import vllm._C_stable_libtorch
from vllm.vllm_flash_attn import _vllm_fa2_C
BLOCK_FP8 = torch.ops._C.cutlass_scaled_mm_supports_block_fp8(90)
"""

DCP_MODULE = (
    CUDA_IMPORTS
    + """
class MLADCPManager:
    def _gather_query(self, x):
        return x

class _Kernel:
    kernel = None

_CORRECT_ATTN_CP_OUT_KERNEL = _Kernel()

def cp_lse_ag_out_rs(*args, **kwargs):
    pass

def dcp_a2a_lse_reduce(*args, **kwargs):
    pass
"""
)

FAKE_VLLM = {
    "vllm/__init__.py": "__version__ = '0.0.fake'\n",
    "vllm/triton_utils/__init__.py": "HAS_TRITON = True\n",
    "vllm/vllm_flash_attn/__init__.py": "",
    "vllm/v1/__init__.py": "",
    "vllm/v1/attention/__init__.py": "",
    "vllm/v1/attention/backends/__init__.py": "",
    "vllm/v1/attention/backends/mla/__init__.py": "",
    "vllm/v1/attention/backends/mla/compressor_utils.py": "def get_compressed_slot_mapping(*a, **k):\n    pass\n",
    "vllm/v1/attention/backends/mla/sparse_utils.py": "def triton_filter_and_convert_dcp_index(*a, **k):\n    pass\n",
    "vllm/v1/attention/ops/__init__.py": "",
    "vllm/v1/attention/ops/dcp.py": DCP_MODULE,
    "vllm/v1/worker/__init__.py": "",
    "vllm/v1/worker/block_table.py": "_COMPUTE_SLOT_MAPPING_KERNEL = None\n",
}

# A vLLM whose DCP module needs a package that is not installed.
MISSING_DEPENDENCY = {
    **FAKE_VLLM,
    "vllm/v1/attention/ops/dcp.py": "raise ModuleNotFoundError(\"No module named 'msgspec'\", name='msgspec')\n",
}

# DCP2 port modules that fail to import the two ways a carried tree can.
PORTS = {
    "port_raising_at_import.py": (
        "raise AttributeError(\"'_OpNamespace' '_C' object has no attribute 'cutlass_scaled_mm_supports_fp4'\")\n"
    ),
    "port_missing_dependency.py": "import flashinfer_absent_here\n",
}


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


# (case, vLLM tree, --dcp-impl, what the one line must say)
CASES = [
    ("vllm missing a dependency", MISSING_DEPENDENCY, "vllm", "module 'msgspec' is missing"),
    ("dsv41 missing a dependency", MISSING_DEPENDENCY, "dsv41", "module 'msgspec' is missing"),
    (
        "dsv41 port raising at import",
        FAKE_VLLM,
        "dsv41:port_raising_at_import:Attention",
        "importing port_raising_at_import",
    ),
    (
        "dsv41 port missing a dependency",
        FAKE_VLLM,
        "dsv41:port_missing_dependency:Attention",
        "No module named 'flashinfer_absent_here'",
    ),
    ("dsv41 tree without the port", FAKE_VLLM, "dsv41", "cannot find module 'vllm.models.deepseek_v41"),
]


@pytest.fixture(scope="module")
def probe_results(tmp_path_factory):
    results = {}
    for tree in (MISSING_DEPENDENCY, FAKE_VLLM):
        tmp_path = tmp_path_factory.mktemp("vllm_usage")
        _write_tree(tmp_path, {**tree, **PORTS})
        write_session(tmp_path, {"test_multi.py": MULTI_RANK_TESTS})
        cases = {name: (["--dcp-impl", impl, "test_multi.py"], {}) for name, t, impl, _ in CASES if t is tree}
        results.update(run_sessions_in_one_interpreter(tmp_path, cases, timeout=120))
    return results


@pytest.mark.parametrize("name, expected", [(c[0], c[3]) for c in CASES], ids=[c[0] for c in CASES])
def test_broken_vllm_is_a_one_line_usage_error(probe_results, name, expected):
    code, output = probe_results[name]
    assert code == 4, output
    assert "Traceback" not in output and "INTERNALERROR" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 1 and expected in errors[0], output


DESCRIBE = """
import json
from dcpcheck.impls.registry import load_implementation
impl = load_implementation("vllm")
import vllm._C_stable_libtorch as stand_in
try:
    stand_in.cutlass_scaled_mm
    reached = None
except AttributeError as exc:
    reached = str(exc)
print(json.dumps({"header": impl.describe(), "reached": reached}))
"""


def _describe(tmp_path: Path) -> dict:
    env = inner_env(TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    proc = subprocess.run(
        [sys.executable, "-c", DESCRIBE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_stand_ins_are_declared_and_have_nothing(tmp_path):
    _write_tree(tmp_path, FAKE_VLLM)
    result = _describe(tmp_path)
    header = result["header"].split(" | ")
    assert header == [
        "vllm 0.0.fake",
        "`vllm._C_stable_libtorch`: stand-in (compiled extensions not carried): an empty module",
        "`torch.ops._C.cutlass_scaled_mm_supports_block_fp8`: stand-in (compiled extensions not carried): "
        "False, read at import by w8a8_utils",
        "`vllm.vllm_flash_attn._vllm_fa2_C`: stand-in (compiled extensions not carried): an empty module",
    ], result
    assert "stand-in" in result["reached"] and "'cutlass_scaled_mm'" in result["reached"], result


def test_no_stand_in_where_the_extensions_are_installed(tmp_path):
    _write_tree(
        tmp_path,
        {
            **FAKE_VLLM,
            "vllm/_C_stable_libtorch.py": "cutlass_scaled_mm = None\n",
            "vllm/vllm_flash_attn/_vllm_fa3_C.py": "",
            "vllm/v1/attention/ops/dcp.py": DCP_MODULE.replace("_vllm_fa2_C", "_vllm_fa3_C").replace(
                "BLOCK_FP8 = torch.ops._C.cutlass_scaled_mm_supports_block_fp8(90)\n", ""
            ),
        },
    )
    assert _describe(tmp_path) == {"header": "vllm 0.0.fake", "reached": None}
