"""``tools/build_dsv41_tree.sh`` never deletes, writes or patches anything
outside its OUT: an OUT that is, holds or lies inside the vLLM it mirrors is
refused, a file reached through a folder link out of the tree is refused, the
tree is built beside OUT and swapped in only when every hunk applied, a diff
that removes a file the port imports is refused with the file named, and
bytes that are not UTF-8 or odd paths in the diff are one ``error:`` line
(exit 2), never a traceback.

Runs on a fake installed vLLM in a fake venv of ``tmp_path`` (its python runs
this interpreter with the fake on its path): no vLLM needed, and the real
install is never at risk."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BUILD = ROOT / "tools" / "build_dsv41_tree.sh"
PORT_FILE = "vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py"
COMPANION = "vllm/model_executor/kernels/attention/dsa/candidate_blocks.py"

pytestmark = pytest.mark.skipif(shutil.which("patch") is None, reason="needs GNU patch, which the build applies with")

FAKE_VLLM = {
    "vllm/__init__.py": "",
    "vllm/utils.py": "A = 1\n",
    PORT_FILE: f"from {COMPANION[:-3].replace('/', '.')} import candidates\n\nX = candidates()\n",
    COMPANION: "def candidates():\n    return 0\n",
    "vllm/model_executor/kernels/attention/dsa/__init__.py": "",  # as in vLLM, the folder holds more (patch removes a folder it empties)
}
PATCH_UTILS = "--- a/vllm/utils.py\n+++ b/vllm/utils.py\n@@ -1 +1 @@\n-A = 1\n+A = 2\n"
NOT_APPLYING = "--- a/vllm/utils.py\n+++ b/vllm/utils.py\n@@ -1 +1 @@\n-A = 9\n+A = 3\n"


@pytest.fixture
def fake(tmp_path: Path) -> dict[str, Path]:
    """A venv whose vLLM (site/vllm) has a folder link, vllm/ext, to a folder outside it (elsewhere)."""
    site, elsewhere, venv = tmp_path / "site", tmp_path / "elsewhere", tmp_path / "venv"
    for path, text in FAKE_VLLM.items():
        (site / path).parent.mkdir(parents=True, exist_ok=True)
        (site / path).write_text(text)
    elsewhere.mkdir()
    (elsewhere / "mod.py").write_text("B = 1\n")
    (site / "vllm" / "ext").symlink_to(elsewhere)
    python = venv / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return {"site": site, "elsewhere": elsewhere, "venv": venv, "tmp": tmp_path}


def snapshot(folder: Path) -> dict[str, str | bytes]:
    """Every entry under ``folder``, links not followed: a link's target, a file's bytes."""
    entries: dict[str, str | bytes] = {}
    for parent, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(parent) / name
            key = path.relative_to(folder).as_posix()
            if path.is_symlink():
                entries[key] = os.readlink(path)
            elif path.is_file():
                entries[key] = path.read_bytes()
    return entries


def build(fake: dict[str, Path], out: Path, diff: str | bytes) -> subprocess.CompletedProcess:
    path = fake["tmp"] / "port.diff"
    path.write_bytes(diff if isinstance(diff, bytes) else diff.encode())
    command = [str(BUILD), str(out), str(path), str(fake["venv"])]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def assert_one_error_line(done: subprocess.CompletedProcess, *says: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("error: "), done.stderr
    for said in says:
        assert said in done.stderr


@pytest.mark.parametrize("out", ["site", "site/vllm", "site/vllm/sub", ".", "alias"])
def test_an_out_that_is_holds_or_lies_inside_the_installed_vllm_is_refused_and_it_stays(fake, out):
    (fake["tmp"] / "alias").symlink_to(fake["site"])  # a link to the folder vLLM is installed in
    before = snapshot(fake["site"])
    done = build(fake, fake["tmp"] / out, PATCH_UTILS)
    assert_one_error_line(done, "the vLLM it mirrors")
    assert snapshot(fake["site"]) == before


def test_a_file_reached_through_a_folder_link_out_of_the_tree_is_refused_not_patched(fake):
    before = snapshot(fake["elsewhere"])
    done = build(
        fake, fake["tmp"] / "tree", "--- a/vllm/ext/mod.py\n+++ b/vllm/ext/mod.py\n@@ -1 +1 @@\n-B = 1\n+B = 2\n"
    )
    assert_one_error_line(done, "vllm/ext/mod.py", "outside the tree")
    assert snapshot(fake["elsewhere"]) == before
    assert not (fake["tmp"] / "tree").exists()


def test_an_existing_out_keeps_its_tree_and_files_when_a_hunk_fails_and_nothing_is_left_beside_it(fake):
    out = fake["tmp"] / "tree"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    assert build(fake, out, PATCH_UTILS).returncode == 0
    before = snapshot(out)
    beside = sorted(os.listdir(fake["tmp"]))
    done = build(fake, out, NOT_APPLYING)
    assert done.returncode == 2 and "hunk #1" in done.stderr
    assert snapshot(out) == before  # the earlier tree, whole, and the user's file
    assert sorted(os.listdir(fake["tmp"])) == beside  # no half-built tree beside OUT
    assert build(fake, out, PATCH_UTILS.replace("+A = 2", "+A = 4")).returncode == 0
    assert (out / "vllm" / "utils.py").read_text() == "A = 4\n" and (out / "notes.txt").read_text() == "mine\n"
    assert sorted(os.listdir(fake["tmp"])) == beside


def test_a_diff_that_removes_a_file_the_port_imports_is_refused_naming_it_not_stubbed(fake):
    removal = f"--- a/{COMPANION}\n+++ /dev/null\n@@ -1,2 +0,0 @@\n-def candidates():\n-    return 0\n"
    done = build(fake, fake["tmp"] / "tree", removal)
    assert_one_error_line(done, COMPANION, PORT_FILE)
    assert not (fake["tmp"] / "tree").exists()


@pytest.mark.parametrize(
    "diff, says",
    [
        (PATCH_UTILS.encode().replace(b"A = 2", b"A = '\xff'"), "line 5: byte 0xff is not UTF-8"),
        ("--- /dev/null\n+++ b/vllm/utils.py/inner.py\n@@ -0,0 +1 @@\n+C = 1\n", "vllm/utils.py is a file"),
        ("--- /dev/null\n+++ b/vllm/new\x00.py\n@@ -0,0 +1 @@\n+C = 1\n", "not a file of vLLM's vllm/ folder"),
        ("--- /dev/null\n+++ /vllm/abs.py\n@@ -0,0 +1 @@\n+C = 1\n", "not a file of vLLM's vllm/ folder"),
        ("--- /dev/null\n+++ b/vllm/../abs.py\n@@ -0,0 +1 @@\n+C = 1\n", "not a file of vLLM's vllm/ folder"),
        ("--- a/vllm/ext\n+++ b/vllm/ext\n@@ -1 +1 @@\n-B = 1\n+B = 2\n", "vllm/ext: a folder"),
    ],
    ids=["non-utf8-byte", "under-a-file", "nul", "absolute", "dotdot", "a-folder"],
)
def test_bytes_and_odd_paths_are_one_error_line(fake, diff, says):
    before = snapshot(fake["tmp"] / "site") | snapshot(fake["elsewhere"])
    done = build(fake, fake["tmp"] / "tree", diff)
    assert_one_error_line(done, says)
    assert "Traceback" not in done.stderr
    assert snapshot(fake["tmp"] / "site") | snapshot(fake["elsewhere"]) == before
    assert not (fake["tmp"] / "tree").exists()


def test_a_form_feed_or_a_unicode_line_separator_stays_inside_its_line(fake):
    added = "A = 1\n# page\x0cbreak, line\u2028separator\n"  # str.splitlines breaks at both: the file was cut short
    diff = "--- /dev/null\n+++ b/vllm/added.py\n@@ -0,0 +1,2 @@\n+A = 1\n+# page\x0cbreak, line\u2028separator\n"
    done = build(fake, fake["tmp"] / "tree", diff)
    assert done.returncode == 0, done.stderr
    assert (fake["tmp"] / "tree" / "vllm" / "added.py").read_text() == added
