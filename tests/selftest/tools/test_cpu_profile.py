"""``tools/cpu_profile.py`` sorts py-spy's samples into kinds of work, by
process and per interpreted kernel (nested @triton.jit calls' re-patching
apart, with or without dcpcheck's shortcut in its place), and refuses a
missing sample file with what it accepts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))

from cpu_profile import Profile, main, process_kind_of  # tools/ is on sys.path

from dcpcheck.ranks.zygote_server import ServerKind
from tests.selftest.support.inner import WARM_SERVER

RANK = 'process 10:"python -m pytest -n 2";process 11:"python -u -c import sys;exec(eval(sys.stdin.readline()))";'
RANK += 'process 12:"python -m dcpcheck.ranks.worker --world-size 2";process 13:"python -m dcpcheck.ranks.worker";'
CASE = RANK + "run_rank_case (dcpcheck/ranks/rankfn.py:90);combine (dcpcheck/port/combine.py:250);"
LAUNCH = CASE + "GridExecutor.__call__ (triton/runtime/interpreter.py:1520);"
KERNEL = LAUNCH + "_sum_received_kernel (dcpcheck/port/combine.py:125);"
RAW = "\n".join(
    [
        KERNEL + "InterpretedFunction.__call__ (triton/runtime/interpreter.py:1698);"
        "_patch_lang (triton/runtime/interpreter.py:1349) 2",
        KERNEL + "InterpretedFunction.__call__ (triton/runtime/interpreter.py:1698);"
        "keep_lang_patched (dcpcheck/triton_interpreter/language_shortcut.py:138) 1",
        KERNEL + "binary_op (triton/runtime/interpreter.py:700) 5",
        LAUNCH + "getfullargspec (inspect.py:1300) 2",
        LAUNCH
        + "keep_lang_patched (dcpcheck/triton_interpreter/language_shortcut.py:138);Shortcut.patch (dcpcheck/triton_interpreter/language_shortcut.py:73);"
        "_patch_lang (triton/runtime/interpreter.py:1349) 1",
        RANK + "<module> (dcpcheck/ranks/worker.py:1);_find_and_load (<frozen importlib._bootstrap>:1) 4",
        CASE + "sparse_attention (dcpcheck/oracle/attention.py:40) 2",
        CASE
        + "Vectoriser.call (dcpcheck/triton_interpreter/vectorised_launches.py:100);_vectorised_call (dcpcheck/triton_interpreter/vectorised_launches.py:200);"
        "_dcp_a2a_unpack_combine_kernel (vllm/v1/attention/ops/dcp.py:725);binary_op (triton/runtime/interpreter.py:700) 4",
        'process 20:"python -m tests.selftest.support.session_probe cases.json";main (session_probe.py:9) 3',
        'process 30:"python -m dcpcheck.ranks.zygote_server --fd 15";process 31:"python -m dcpcheck.ranks.zygote_server";'
        "zygote_main (dcpcheck/ranks/worker.py:160) 2",
        "not a stack line",
    ]
)


def test_samples_are_sorted_by_kind_process_and_kernel():
    profile = Profile.read(RAW.splitlines())
    assert profile.total == 26
    assert profile.kinds == {
        "Triton interpreter: triton.language patched again at a nested @triton.jit call": 3,
        "Triton interpreter: kernel bodies": 9,
        "Triton interpreter: per launch (triton.language patched, arguments copied)": 3,
        "imports at a process's start (interpreter, torch, plugins)": 4,
        "float64 oracle": 2,
        "other": 5,
    }
    assert profile.processes == {"pool zygote and ranks": 23, "inner sessions of self-tests (session probe)": 3}
    kernel = "_sum_received_kernel (dcpcheck/port/combine.py)"
    vectorised = "_dcp_a2a_unpack_combine_kernel (vllm/v1/attention/ops/dcp.py)"
    assert profile.kernels == {kernel: 8, vectorised: 4}
    assert profile.nested_patching == {kernel: 3}


def test_report_writes_its_markdown_and_refuses_a_missing_file(tmp_path, capsys):
    raw, markdown = tmp_path / "samples.txt", tmp_path / "report.md"
    raw.write_text(RAW)
    assert main(["report", "--raw", str(raw), "--markdown", str(markdown)]) == 0
    report = markdown.read_text()
    assert report == capsys.readouterr().out
    assert "| Triton interpreter: kernel bodies | 34.6 % |" in report  # 9 of 26
    assert "| `_sum_received_kernel (dcpcheck/port/combine.py)` | 30.8 % | 11.5 % |" in report
    assert "| `_dcp_a2a_unpack_combine_kernel (vllm/v1/attention/ops/dcp.py)` | 15.4 % | 0.0 % |" in report
    with pytest.raises(SystemExit, match="no samples at .*missing.txt; accepted: a file written by `run`"):
        main(["report", "--raw", str(tmp_path / "missing.txt")])


def test_the_self_tests_warm_interpreter_is_told_from_the_pools_zygote_servers():
    warm, pools = " ".join(WARM_SERVER.command(7)), " ".join(ServerKind(("torch.distributed",), None, "cpu").command(7))
    assert process_kind_of(warm) == "inner sessions of self-tests (warm interpreter)", warm
    assert process_kind_of(pools) == "pool zygote and ranks", pools
