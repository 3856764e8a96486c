"""What the tools (``gpu_ci.py``, ``diff_coverage.py``) check their arguments
with: a usage error is one line and exit 2, as the plugin's are, before any
run starts. The tools import it from their own folder (``sys.path[0]``)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


class OneLineParser(argparse.ArgumentParser):
    """A usage error is one line, as the plugin's are (argparse would print the usage first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def folder_problem(path: Path) -> str | None:
    """Why ``path`` cannot be used or made as a folder to write in, else None."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def file_problem(path: Path) -> str | None:
    """Why ``path`` cannot be written as a file (its folder made as needed), else None."""
    return f"{path} is a folder" if path.is_dir() else folder_problem(path.parent)
