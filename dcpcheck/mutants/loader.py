"""Load a mutant: a fresh copy of the port, patched, imported under its own name.

Triton reads a kernel's source from its file, so the copy is real files in a
temporary directory. It is imported as the package ``dcpcheck_mutant_<Name>``
(the same name in every process, so what one rank pickles another can load),
and the mutant is that copy's :class:`EmbeddedPort`: the whole port with the
one change, however deep in a kernel it sits.
"""

from __future__ import annotations

import ast
import atexit
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

from dcpcheck.mutants.patch import PORT_DIR, Mutant

PACKAGE_PREFIX = "dcpcheck_mutant_"
COPY_PREFIX = "dcpcheck-mutant-"  # + the creating process id: temporary directories of copies


def _absolute_dcpcheck_imports(package: Path) -> list[str]:
    """``file: module`` for each import of dcpcheck in the copy: through one,
    the copy would run the unpatched port (or the suite) instead of itself."""
    found = []
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module or ""]
            found += [f"{path.name}: {module}" for module in modules if module.split(".")[0] == "dcpcheck"]
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    return True


def _remove_orphaned_copies() -> None:
    """Remove the copies of processes that died before their exit handler ran
    (ranks killed after a failed or stuck case)."""
    for path in Path(tempfile.gettempdir()).glob(f"{COPY_PREFIX}*"):
        pid = path.name[len(COPY_PREFIX) :].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _remove_at_exit(root: Path) -> None:
    creator = os.getpid()

    def remove() -> None:
        if os.getpid() == creator:  # not in a forked rank, which shares the copy
            shutil.rmtree(root, ignore_errors=True)

    atexit.register(remove)


def _write_copy(mutant: Mutant, package: str) -> Path:
    patched = mutant.patch.applied()  # raises StalePatch before anything is written
    _remove_orphaned_copies()
    root = Path(tempfile.mkdtemp(prefix=f"{COPY_PREFIX}{os.getpid()}-{mutant.name}-"))
    _remove_at_exit(root)
    copy = root / package
    shutil.copytree(PORT_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / mutant.patch.file).write_text(patched)
    outside = _absolute_dcpcheck_imports(copy)
    if outside:
        raise ImportError(f"the port must import only itself (relative imports); it imports {outside}")
    return copy


def load(mutant: Mutant) -> type:
    """The patched copy's EmbeddedPort class, named after the mutant (once per process)."""
    package = PACKAGE_PREFIX + mutant.name
    if package not in sys.modules:
        copy = _write_copy(mutant, package)
        spec = importlib.util.spec_from_file_location(
            package, copy / "__init__.py", submodule_search_locations=[str(copy)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[package] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            for name in [name for name in sys.modules if name.split(".")[0] == package]:
                del sys.modules[name]  # a later load starts over, not from a half-imported copy
            raise
    port = importlib.import_module(f"{package}.impl").EmbeddedPort
    port.name = mutant.name
    return port
