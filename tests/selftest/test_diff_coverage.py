"""``tools/diff_coverage.py`` counts the statements a port's diff adds or
changes, per stage folder of the tests that ran them, and gives each line not
run its reason (or none: unexplained)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("coverage")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from diff_coverage import PORT_FILE, diff_statements, executed_by_stage, main, reason_for  # tools/ is on sys.path

STOCK = '''import torch


def _forward(x):
    """Attention."""
    return x
'''
PORTED = '''import torch

_GATHER = True  # new, module level


def _forward(x):
    """Attention.

    A docstring line the diff adds."""
    # a comment the diff adds
    if _GATHER:
        y = min(
            x,
            2,  # a changed continuation line counts as its statement
        )
        return _run_sm120_dcp(y)
    return x


def _run_sm120_dcp(y):
    ev = torch.cuda.Event(enable_timing=True)
    return y
'''


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A tree whose vllm/ links to a stock vLLM, with the port file patched."""
    stock = tmp_path / "site" / "vllm"
    (stock / Path(PORT_FILE).parent.relative_to("vllm")).mkdir(parents=True)
    (stock / "__init__.py").write_text("")
    (stock / Path(PORT_FILE).relative_to("vllm")).write_text(STOCK)
    port = tmp_path / "tree" / PORT_FILE
    port.parent.mkdir(parents=True)
    (tmp_path / "tree" / "vllm" / "__init__.py").symlink_to(stock / "__init__.py")
    port.write_text(PORTED)
    return tmp_path / "tree"


def statement(tree: Path, text: str) -> int:
    return next(n for n, line in enumerate((tree / PORT_FILE).read_text().splitlines(), 1) if text in line)


def test_only_the_statements_the_diff_adds_count(tree):
    port, stock = tree / PORT_FILE, tree / "vllm" / "__init__.py"
    stock = stock.resolve().parent / Path(PORT_FILE).relative_to("vllm")
    lines = {line.number: line for line in diff_statements(port, stock)}
    expected = [
        "_GATHER = True",
        "if _GATHER:",
        "y = min(",
        "return _run_sm120_dcp(y)",
        "def _run_sm120_dcp",
        "ev =",
        "return y",
    ]
    assert sorted(lines) == sorted(statement(tree, text) for text in expected)
    assert lines[statement(tree, "_GATHER = True")].function == ""
    assert lines[statement(tree, "if _GATHER:")].function == "_forward"


def test_a_line_not_run_gets_its_reason_or_shows_unexplained(tree):
    port = tree / PORT_FILE
    stock = (tree / "vllm" / "__init__.py").resolve().parent / Path(PORT_FILE).relative_to("vllm")
    lines = {line.code: line for line in diff_statements(port, stock)}
    assert reason_for(lines["ev = torch.cuda.Event(enable_timing=True)"]).startswith("timing diagnostics")
    assert reason_for(lines["if _GATHER:"]) == "UNEXPLAINED"


def test_lines_count_for_the_stage_folder_of_the_test_that_ran_them(tree, tmp_path, capsys):
    from coverage import CoverageData

    port = tree / PORT_FILE
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    ran = {
        "tests/stage9_prefill/test_gather.py::test_x[W2]": [statement(tree, "if _GATHER:")],
        "tests.e2e.test_trace.test_y": [statement(tree, "y = min("), statement(tree, "if _GATHER:")],
        "": [statement(tree, "_GATHER = True")],  # the module's execution, outside any test
    }
    for index, (context, lines) in enumerate(ran.items()):
        data = CoverageData(basename=str(data_dir / f".coverage.rank{index}"))
        data.set_context(context)
        data.add_lines({str(port): lines})
        data.write()
    by_stage = executed_by_stage(data_dir, port)
    assert by_stage[statement(tree, "if _GATHER:")] == {"stage9_prefill", "e2e"}
    assert by_stage[statement(tree, "_GATHER = True")] == {""}
    assert main(["report", "--tree", str(tree), "--data", str(data_dir)]) == 0
    report = capsys.readouterr().out
    assert "| stage9_prefill | 1 | 5 | 20 |" in report
    assert "| e2e | 2 | 5 | 40 |" in report
    assert "module level (run on import): 1 of 2 run." in report
    assert "4 not run, 3 of them unexplained." in report


def test_a_folder_without_data_is_a_one_line_usage_error(tree, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["report", "--tree", str(tree), "--data", str(tmp_path)])
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert f": error: --data {tmp_path}: no coverage data (measure first: tools/diff_coverage.py run" in line
