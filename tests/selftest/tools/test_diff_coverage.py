"""``tools/diff_coverage.py`` counts the statements a port's diff adds or
changes in every file the tree changes against the vLLM it links to, per file
and per stage folder of the tests that ran them, and gives each line not run
its reason (or none: unexplained)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("coverage")
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))

from diff_coverage import (  # tools/ is on sys.path
    BUILD_MARKER,
    PORT_FILE,
    changed_files,
    diff_statements,
    executed_by_stage,
    main,
    reason_for,
)

OTHER_FILE = "vllm/v1/attention/backends/mla/sparse_utils.py"
NEW_FILE = "vllm/v1/attention/ops/dcp_helpers.py"
SAME_FILE = "vllm/config.py"  # a real copy, identical to vLLM's: not changed
LINKED_FILE = "vllm/logger.py"
COMPANION = "vllm/model_executor/kernels/attention/dsa/candidate_blocks.py"
COMMENT_ONLY = "vllm/envs.py"  # the diff adds a comment: changed, no statement to count

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
OTHER_STOCK = """def filter_index(x):
    return x
"""
OTHER_PORTED = """def filter_index(x):
    if x is None:
        raise RuntimeError("no index")
    return x
"""
NEW = """def helper():
    return 1
"""
COMPANION_STOCK = """def candidates():
    return 0
"""
COMPANION_PORTED = f"""def candidates():
    return 1


{BUILD_MARKER} for the DCP2 stack's prefill timing (diagnostics only) ----
_PREFILL_TIMING = False


def prefill_acc_add(*args, **kwargs):
    return None
"""


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A tree whose vllm/ links to a stock vLLM, with the port file, another file and the
    build script's companion patched, a file added, one real identical copy and one link."""
    site, tree = tmp_path / "site", tmp_path / "tree"
    stock = {
        "vllm/__init__.py": "",
        PORT_FILE: STOCK,
        OTHER_FILE: OTHER_STOCK,
        SAME_FILE: "SAME = 1\n",
        LINKED_FILE: "LOG = 1\n",
        COMPANION: COMPANION_STOCK,
        COMMENT_ONLY: "X = 1\n",
    }
    for path, text in stock.items():
        write(site / path, text)
    for path in ("vllm/__init__.py", LINKED_FILE):
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        (tree / path).symlink_to(site / path)
    own = {
        PORT_FILE: PORTED,
        OTHER_FILE: OTHER_PORTED,
        NEW_FILE: NEW,
        SAME_FILE: "SAME = 1\n",
        COMMENT_ONLY: "# new\nX = 1\n",
    }
    for path, text in {**own, COMPANION: COMPANION_PORTED}.items():
        write(tree / path, text)
    return tree


def changed(tree: Path, path: str):
    return next(file for file in changed_files(tree) if file.path == path)


def statement(tree: Path, text: str, path: str = PORT_FILE) -> int:
    return next(n for n, line in enumerate((tree / path).read_text().splitlines(), 1) if text in line)


def test_only_the_statements_the_diff_adds_count(tree):
    lines = {line.number: line for line in diff_statements(changed(tree, PORT_FILE))}
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


def test_every_real_file_that_differs_from_vllm_or_is_new_is_measured(tree):
    files = {file.path: file for file in changed_files(tree)}
    assert sorted(files) == sorted([PORT_FILE, OTHER_FILE, NEW_FILE, COMPANION, COMMENT_ONLY])  # not the link, the copy
    assert files[NEW_FILE].stock is None
    assert [line.code for line in diff_statements(files[NEW_FILE])] == ["def helper():", "return 1"]
    assert [line.code for line in diff_statements(files[OTHER_FILE])] == [
        "if x is None:",
        'raise RuntimeError("no index")',
    ]


def test_the_build_scripts_stand_ins_are_not_the_diffs(tree):
    assert [line.code for line in diff_statements(changed(tree, COMPANION))] == ["return 1"]


def test_a_line_not_run_gets_its_files_reason_or_shows_unexplained(tree):
    lines = {line.code: line for line in diff_statements(changed(tree, PORT_FILE))}
    assert reason_for(lines["ev = torch.cuda.Event(enable_timing=True)"]).startswith("timing diagnostics")
    assert reason_for(lines["if _GATHER:"]) == "UNEXPLAINED"
    (other_raise,) = [line for line in diff_statements(changed(tree, OTHER_FILE)) if "raise" in line.code]
    assert reason_for(other_raise) == "UNEXPLAINED"  # the port's FlashInfer reason is keyed to the port's file


def record(data_dir: Path, ran: dict[str, dict[Path, list[int]]]) -> None:
    """Coverage data as the measured processes write it: per context, the lines of each file run."""
    from coverage import CoverageData

    data_dir.mkdir()
    for index, (context, files) in enumerate(ran.items()):
        data = CoverageData(basename=str(data_dir / f".coverage.rank{index}"))
        data.set_context(context)
        data.add_lines({str(path): lines for path, lines in files.items()})
        data.write()


def test_lines_count_per_file_for_the_stage_folder_of_the_test_that_ran_them(tree, tmp_path, capsys):
    port, other = tree / PORT_FILE, tree / OTHER_FILE
    data_dir = tmp_path / "data"
    record(
        data_dir,
        {
            "tests/stage9_prefill/test_gather.py::test_x[W2]": {port: [statement(tree, "if _GATHER:")]},
            "tests.e2e.test_trace.test_y": {
                port: [statement(tree, "y = min("), statement(tree, "if _GATHER:")],
                other: [statement(tree, "if x is None:", OTHER_FILE)],
            },
            "": {port: [statement(tree, "_GATHER = True")]},  # the module's execution, outside any test
        },
    )
    by_stage = executed_by_stage(data_dir, [port, other])
    assert by_stage[str(port.resolve())][statement(tree, "if _GATHER:")] == {"stage9_prefill", "e2e"}
    assert by_stage[str(port.resolve())][statement(tree, "_GATHER = True")] == {""}
    assert main(["report", "--tree", str(tree), "--data", str(data_dir)]) == 0
    report = capsys.readouterr().out
    assert f"| `{PORT_FILE}` | 2 | 5 | 40 | 1 | 2 | 4 | 3 |" in report  # the summary: a line per file
    assert f"| `{OTHER_FILE}` | 1 | 2 | 50 | 0 | 0 | 1 | 1 |" in report
    assert f"| `{NEW_FILE}` | 0 | 1 | 0 | 0 | 1 | 2 | 2 |" in report
    assert f"Changed without a statement to count (comments, removed lines, the stand-ins): `{COMMENT_ONLY}`." in report
    assert f"`{COMMENT_ONLY}` |" not in report and f"## `{COMMENT_ONLY}`" not in report
    port_section = report.split(f"## `{PORT_FILE}`")[1].split("## ")[0]
    assert "| stage9_prefill | 1 | 5 | 20 |" in port_section
    assert "| e2e | 2 | 5 | 40 |" in port_section
    assert "module level (run on import): 1 of 2 run." in port_section
    assert "4 not run, 3 of them unexplained." in port_section
    other_section = report.split(f"## `{OTHER_FILE}`")[1].split("## ")[0]
    assert '| 3 | filter_index | `raise RuntimeError("no index")` | UNEXPLAINED |' in other_section


def test_a_folder_without_data_is_a_one_line_usage_error(tree, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["report", "--tree", str(tree), "--data", str(tmp_path)])
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert f": error: --data {tmp_path}: no coverage data (measure first: tools/diff_coverage.py run" in line


def test_a_tree_without_links_to_vllm_is_a_one_line_usage_error(tmp_path, capsys):
    write(tmp_path / "tree" / PORT_FILE, PORTED)
    with pytest.raises(SystemExit) as exited:
        main(["report", "--tree", str(tmp_path / "tree"), "--data", str(tmp_path)])
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith(
        f"--tree {tmp_path / 'tree'}: no vllm/ of links to an installed vLLM (build one with tools/build_dsv41_tree.sh)"
    )


def test_a_file_in_the_encoding_it_declares_is_read_as_python_reads_it(tree, tmp_path, capsys):
    latin = "vllm/v1/attention/ops/latin.py"
    (tree / latin).write_bytes(b'# -*- coding: latin-1 -*-\ndef name():\n    return "caf\xe9"\n')
    data_dir = tmp_path / "data"
    record(data_dir, {"tests/stage1_index/test_x.py::test_y[W2]": {tree / latin: [3]}})
    assert main(["report", "--tree", str(tree), "--data", str(data_dir)]) == 0
    report = capsys.readouterr().out
    assert f"| `{latin}` | 1 | 1 | 100 | 0 | 1 | 1 | 1 |" in report  # the def, at module level, not run
    assert "| 2 | - | `def name():` | UNEXPLAINED |" in report


def test_a_file_not_in_the_encoding_it_declares_is_a_one_line_usage_error(tree, tmp_path, capsys):
    (tree / OTHER_FILE).write_bytes(b"# -*- coding: ascii -*-\nNAME = 'caf\xe9'\n")
    with pytest.raises(SystemExit) as exited:
        main(["report", "--tree", str(tree), "--data", str(tmp_path)])
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert f"--tree {tree}: {OTHER_FILE} does not parse" in line
