"""Apply a porter's diff of vLLM files to a tree of links to the installed
vLLM (``tools/build_dsv41_tree.sh`` calls it): each file the diff patches or
adds becomes a real file in the tree, the rest stay links.

    apply_diff.py OUT STOCK DIFF     # OUT/vllm: the links; STOCK: the installed vllm/ folder

DIFF is ``git diff`` or ``git format-patch`` output of vLLM's repository
(``--- a/vllm/...`` ``+++ b/vllm/...``; a new file from ``/dev/null``, a
removed one to it), one section per file, or the seed diff, whose one file
``SEED_PATHS`` maps; its lines end at a newline (or CR LF) only. Each section
is applied with GNU ``patch`` in the order of the diff (a file may come twice,
as in a series). A hunk that does not apply prints ``error: <file>: hunk #N
(<its @@ line>) did not apply``, for every such hunk of every file, and exits 2; so do a path outside ``vllm/``
(absolute, with ``..`` or a NUL), a file under a file, a folder, a file whose
real path leaves OUT (through a folder link into or out of the installed
vLLM: never written through), a rename, a binary patch, a diff that is not
UTF-8 (vLLM's sources are) and one that removes a file the port imports
(the port would not import; no stand-in is made for it).
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

DEV_NULL = "/dev/null"
# The seed diff (shared/seeds/002_ce6637cb7dfa2225.txt) names its one file as the DCP2 stack's
# launcher bakes it (baked-ours/ before, baked/ after); this is the vLLM file it patches.
SEED_PATHS = {
    "baked-ours/models/deepseek_v4_1/nvidia/flashinfer_sparse.py": "vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py",
    "baked/models/deepseek_v4_1/nvidia/flashinfer_sparse.py": "vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py",
}
PORT_FILE = "vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py"
GIT_PREFIXES = ("a/", "b/")
HUNK_HEADER = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
UNSUPPORTED = re.compile(r"^(rename from |copy from |GIT binary patch|Binary files )")
FAILED_HUNK = re.compile(r"^Hunk #(\d+) FAILED", re.MULTILINE)
PATCH = ["patch", "--batch", "--forward", "--no-backup-if-mismatch", "--reject-file=-", "-F3"]


class DiffError(Exception):
    """Why the diff cannot be applied: main prints each as an ``error:`` line and exits 2."""


@dataclass
class FilePatch:
    path: str  # in the tree: vllm/...
    header: list[str]  # the --- and +++ lines
    hunks: list[list[str]] = field(default_factory=list)  # each from its @@ line
    new: bool = False
    removed: bool = False

    def text(self) -> str:
        return "".join(line + "\n" for line in [*self.header, *(line for hunk in self.hunks for line in hunk)])


def tree_path(diff_path: str) -> str:
    """The file a diff path names in the tree (vllm/...): the seed's by SEED_PATHS, else git's a/ or b/ dropped."""
    path = diff_path.split("\t")[0].strip()  # diff -u appends a timestamp after a tab
    if path in SEED_PATHS:
        return SEED_PATHS[path]
    if path.startswith(GIT_PREFIXES):
        path = path[2:]
    parts = path.split("/")
    if parts[0] != "vllm" or len(parts) < 2 or {"", ".", ".."} & set(parts) or "\0" in path:
        raise DiffError(f"{diff_path}: not a file of vLLM's vllm/ folder (git diff from vLLM's repository root)")
    return path


def section_path(old: str, new: str) -> FilePatch:
    old_name, new_name = (name.split("\t")[0].strip() for name in (old[4:], new[4:]))
    if old_name == DEV_NULL:
        return FilePatch(tree_path(new_name), [old, new], new=True)
    if new_name == DEV_NULL:
        return FilePatch(tree_path(old_name), [old, new], removed=True)
    path = tree_path(old_name)
    if tree_path(new_name) != path:
        raise DiffError(f"{old_name} -> {new_name}: a rename (make the diff with git diff --no-renames)")
    return FilePatch(path, [old, new])


def read_hunk(lines: list[str], start: int) -> list[str]:
    """The hunk whose @@ line is lines[start], up to its last line by the @@ line's counts."""
    match = HUNK_HEADER.match(lines[start])
    old, new = (int(count) if count is not None else 1 for count in match.groups())
    hunk, index = [lines[start]], start + 1
    while old > 0 or new > 0:
        if index == len(lines):
            raise DiffError(f"{lines[start]}: the diff ends inside this hunk")
        line = lines[index]
        kind = line[:1] or " "  # an editor may strip a blank context line to nothing
        old -= kind in " -"
        new -= kind in " +"
        hunk.append(line)
        index += 1
    while index < len(lines) and lines[index].startswith("\\"):  # "\ No newline at end of file"
        hunk.append(lines[index])
        index += 1
    return hunk


def split_diff(text: str) -> list[FilePatch]:
    """The diff's file sections in order; what lies between them (commit messages, git's index lines) is skipped."""
    # Lines end at "\n" (and "\r\n") only: str.splitlines also breaks at a form feed or U+2028, which
    # Python sources may hold, and would cut such a line short of its hunk.
    lines = [line.removesuffix("\r") for line in text.removesuffix("\n").split("\n")]
    sections: list[FilePatch] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if UNSUPPORTED.match(line):
            raise DiffError(f"{line.strip()}: renames and binary patches are not supported (git diff --no-renames)")
        if line.startswith("--- ") and index + 1 < len(lines) and lines[index + 1].startswith("+++ "):
            sections.append(section_path(line, lines[index + 1]))
            index += 2
            while index < len(lines) and HUNK_HEADER.match(lines[index]):
                sections[-1].hunks.append(read_hunk(lines, index))
                index += len(sections[-1].hunks[-1])
            continue
        index += 1
    if not sections:
        raise DiffError("no file in the diff (no '--- ' and '+++ ' lines)")
    return sections


def folder_in_tree(out: Path, section: FilePatch) -> None:
    """Refuse a file whose folder is not a folder of the tree itself: under a file, or reached through a
    folder link (into the installed vLLM or out of it), where writing it would write outside OUT."""
    folder = out
    for part in Path(section.path).parent.parts:
        folder = folder / part
        if folder.exists() and not folder.is_dir():
            raise DiffError(f"{section.path}: {folder.relative_to(out)} is a file; accepted: files in folders")
    if folder.resolve() != out.resolve() / folder.relative_to(out):
        raise DiffError(
            f"{section.path}: outside the tree: its folder is, through a folder link, {folder.resolve()}; "
            "accepted: files whose folders are the tree's own"
        )


def make_real(out: Path, stock: Path, section: FilePatch) -> Path:
    """The tree's file for ``section``, a real file (a copy of the installed one) where it was a link."""
    target = out / section.path
    folder_in_tree(out, section)
    if target.is_dir():
        raise DiffError(f"{section.path}: a folder (its link or its own); accepted: files")
    if section.new:
        if target.exists() or target.is_symlink():
            raise DiffError(f"{section.path}: the diff adds it (--- /dev/null), but vLLM has it")
        target.parent.mkdir(parents=True, exist_ok=True)
        return target
    if not (target.exists() or target.is_symlink()):
        raise DiffError(f"{section.path}: not in the installed vLLM (a new file's diff starts from --- /dev/null)")
    if target.is_symlink():  # never patch through the link: it is the installed vLLM's file
        target.unlink()
        shutil.copy2(stock / Path(section.path).relative_to("vllm"), target)
    return target


def files_the_port_imports(out: Path) -> dict[str, int]:
    """Each tree file (vllm/...) the tree's port file imports by an absolute ``vllm`` import -> its line."""
    port = out / PORT_FILE
    if not port.is_file():
        return {}
    try:
        tree = ast.parse(port.read_bytes())
    except (SyntaxError, ValueError):
        return {}  # the suite names a port that does not parse when it loads it
    imported: dict[str, int] = {}
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        for name in names:
            if name.split(".")[0] == "vllm":
                base = name.replace(".", "/")
                for path in (f"{base}.py", f"{base}/__init__.py"):
                    imported.setdefault(path, node.lineno)
    return imported


def removed_imports(out: Path, sections: list[FilePatch]) -> list[str]:
    """The ``error:`` lines of files the diff removes that the port imports (or the port itself)."""
    imported = files_the_port_imports(out)
    errors = []
    for path in dict.fromkeys(section.path for section in sections if section.removed):
        if (out / path).exists():
            continue  # added again later in the diff
        if path == PORT_FILE:
            errors.append(f"{path}: the diff removes the port itself; accepted: a diff that keeps it")
        elif path in imported:
            errors.append(
                f"{path}: the diff removes it, but the port ({PORT_FILE}) imports it (line {imported[path]}); "
                "accepted: a diff that keeps the files the port imports"
            )
    return errors


def diff_text(diff: Path) -> str:
    """The diff's text: UTF-8 (vLLM's sources are), else the line and byte that are not."""
    data = diff.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DiffError(
            f"{diff}: line {line}: byte 0x{data[exc.start]:02x} is not UTF-8; accepted: a diff in UTF-8 "
            "(as vLLM's sources are)"
        ) from None


def apply(out: Path, stock: Path, section: FilePatch) -> list[str]:
    """Patch the tree's file; the ``error:`` lines of what did not apply, none when all did."""
    target = make_real(out, stock, section)
    result = subprocess.run([*PATCH, str(target)], input=section.text(), capture_output=True, text=True)
    if result.returncode == 0:
        return []
    failed = [int(number) for number in FAILED_HUNK.findall(result.stdout)]
    if not failed:
        said = " ".join((result.stdout + result.stderr).split())
        return [f"{section.path}: patch refused it: {said}"]
    return [f"{section.path}: hunk #{n} ({section.hunks[n - 1][0]}) did not apply" for n in failed]


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: apply_diff.py OUT STOCK DIFF", file=sys.stderr)
        return 2
    out, stock, diff = (Path(arg) for arg in argv)
    try:
        sections = split_diff(diff_text(diff))
        errors = [error for section in sections for error in apply(out, stock, section)]
        errors = errors or removed_imports(out, sections)
    except DiffError as exc:
        errors = [str(exc)]
    except OSError as exc:  # a file the tree or the diff cannot give (permissions, a full disk)
        errors = [str(exc)]
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    if errors:
        return 2
    for section in sections:
        done = "added" if section.new else "removed" if section.removed else "patched"
        print(f"{done}: {section.path} ({len(section.hunks)} hunks)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
