"""What a mutant is: a name, where it should die, and one patch of the port.

A patch replaces an exact piece of text of one port file by another. The old
text must occur exactly once in the current port: when the port changes under
it (the text is gone, or now ambiguous), the patch is *stale*, and the
mutant is reported broken instead of being run as some other bug.
"""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass
from pathlib import Path

from dcpcheck.impls.registry import ImplSpecError

PORT_DIR = Path(__file__).resolve().parent.parent / "port"


class StalePatch(ImplSpecError):
    """The patch's old text does not occur exactly once in the current port."""


@dataclass(frozen=True)
class Patch:
    file: str  # relative to dcpcheck/port/
    old: str  # exact text, found exactly once in the file
    new: str

    def source(self) -> str:
        """The current port file's text."""
        try:
            return (PORT_DIR / self.file).read_text()
        except FileNotFoundError:
            raise StalePatch(f"stale patch: the port has no file {self.file}") from None

    def applied(self) -> str:
        """The port file's text with the patch applied."""
        source = self.source()
        found = source.count(self.old)
        if found != 1:
            raise StalePatch(
                f"stale patch: its old text occurs {found} times in port/{self.file}, not once: {self.old.strip()[:80]!r}"
            )
        return source.replace(self.old, self.new)

    def diff(self) -> str:
        """The patch as a unified diff of its file."""
        before, after = self.source().splitlines(keepends=True), self.applied().splitlines(keepends=True)
        path = f"dcpcheck/port/{self.file}"
        return "".join(difflib.unified_diff(before, after, f"a/{path}", f"b/{path}"))

    def definition(self) -> str:
        """``file:name`` of the top-level definition the old text sits in."""
        source = self.source()
        if source.count(self.old) != 1:
            return self.file
        line = source[: source.find(self.old)].count("\n") + 1
        for node in ast.parse(source).body:
            if node.lineno <= line <= node.end_lineno:
                names = [node.name] if hasattr(node, "name") else [ast.unparse(t) for t in getattr(node, "targets", [])]
                return f"{self.file}:{','.join(names)}"
        return self.file


@dataclass(frozen=True)
class Mutant:
    """The port with one realistic bug; ``home`` is the test dir expected to kill it."""

    name: str
    stage: int
    home: str
    description: str  # one line
    patch: Patch

    def stale(self) -> str | None:
        """Why the patch no longer applies to the current port, or None."""
        try:
            self.patch.applied()
        except StalePatch as exc:
            return str(exc)
        return None
