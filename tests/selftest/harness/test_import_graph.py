"""The import graph stays as docs/developing.md ("Layout") draws it, read from
the source with ``ast`` (nothing is imported; an import inside a function, or
in the source of a subprocess or inner session, counts too):

- no module imports a test module (``test_*.py``, ``conftest.py``): what test
  modules share lives in ``dcpcheck/`` (across test folders) or in a non-test
  module of their own folder (``common.py``), or, for the self-tests, in
  ``tests/selftest/support/`` (their helpers);
- a module under ``tests/`` imports from ``tests/`` its own folder only, and a
  self-test (of any ``tests/selftest/`` folder) its own folder and
  ``tests/selftest/support/``, whose helpers import each other and nothing of
  the self-tests' folders;
- nothing in ``dcpcheck/`` imports ``tests/`` or ``tools/``;
- no import circle among ``dcpcheck/``'s modules;
- no upward arrow: each part of ``dcpcheck/`` imports itself and the parts
  of lower layers only (``LAYERS``), so the code under test (the port) and the
  reference (the oracle) import nothing of the suite, and the implementations
  nothing of the ranks that run them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
ROOTS = ("dcpcheck", "tests", "tools")
SELFTEST = REPO / "tests" / "selftest"
SELFTEST_SUPPORT = SELFTEST / "support"  # what every self-test folder may import

# The parts of dcpcheck/, lowest layer first. A part imports itself and the
# parts of lower layers only; parts of one layer import nothing of each other.
LAYERS = (
    # The code under test, the reference, and what stands alone.
    (
        "dcpcheck.port",
        "dcpcheck.oracle",
        "dcpcheck.group",
        "dcpcheck.plain_tensors",
        "dcpcheck.coverage_context",
        "dcpcheck.spies",
        "dcpcheck.stages",
        "dcpcheck.triton_interpreter",
    ),
    ("dcpcheck.compare",),
    ("dcpcheck.scenarios",),
    ("dcpcheck.impls",),  # the implementations: what the ranks run
    ("dcpcheck.case_terms", "dcpcheck.mutants", "dcpcheck.ranks"),
    ("dcpcheck.checks",),  # what rank functions of several test folders share
    ("dcpcheck.plugin", "dcpcheck.__main__", "dcpcheck"),
)
# Imports known to break a rule above, each with the issue that removes it.
# An entry that no longer holds fails too: take it out.
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {}

# An import written in a string: the source of a subprocess or an inner session.
IMPORT_IN_TEXT = re.compile(r"^\s*(?:from|import)\s+((?:dcpcheck|tests|tools)(?:\.\w+)*)", re.MULTILINE)


def modules() -> dict[str, Path]:
    found = {"conftest": REPO / "conftest.py"}
    for root in ROOTS:
        for path in (REPO / root).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``name`` (at ``path``) imports: a name
    imported from a package counts as its module where it is one."""

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {resolve(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            found |= {resolve(f"{base}.{alias.name}") or resolve(base) for alias in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found |= {resolve(dotted) for dotted in IMPORT_IN_TEXT.findall(node.value)}
    return found - {None, name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def is_test_module(name: str) -> bool:
    last = name.rpartition(".")[2]
    return last.startswith("test_") or last == "conftest"


def folder_of(path: Path) -> Path:
    return path.parent


def may_import_folder(importer: Path, target: Path) -> bool:
    """Whether a module at ``importer`` under tests/ may import the module at
    ``target`` under tests/: its own folder's, or a self-test's the helpers'."""
    return folder_of(importer) == folder_of(target) or (
        folder_of(target) == SELFTEST_SUPPORT and SELFTEST in importer.parents
    )


def part_of(name: str) -> str:
    return ".".join(name.split(".")[:2])


def layer_of(part: str) -> int | None:
    return next((i for i, layer in enumerate(LAYERS) if part in layer), None)


def violations(edges: dict[str, set[str]]) -> dict[tuple[str, str], str]:
    """(importer, imported) -> the rule it breaks."""
    paths = modules()
    found = {}
    for name, targets in edges.items():
        for target in targets:
            if is_test_module(target):
                found[name, target] = "imports a test module"
            elif (
                name.startswith("tests")
                and target.startswith("tests")
                and not may_import_folder(paths[name], paths[target])
            ):
                found[name, target] = "imports another test folder"
            elif name.startswith("dcpcheck") and target.startswith(("tests", "tools")):
                found[name, target] = "dcpcheck imports tests/ or tools/"
            elif name.startswith("dcpcheck") and target.startswith("dcpcheck") and part_of(name) != part_of(target):
                if layer_of(part_of(name)) <= layer_of(part_of(target)):
                    found[name, target] = f"{part_of(name)} may not import {part_of(target)} (LAYERS)"
    return found


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles among dcpcheck's modules (strongly connected
    components of more than one module; Tarjan's algorithm, iterative)."""
    nodes = {name: {t for t in targets if t.startswith("dcpcheck")} for name, targets in edges.items()}
    nodes = {name: targets for name, targets in nodes.items() if name.startswith("dcpcheck")}
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(nodes[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(nodes[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_part_of_dcpcheck_has_a_layer():
    parts = {part_of(name) for name in modules() if name.startswith("dcpcheck")}
    assert not [part for part in sorted(parts) if layer_of(part) is None], "add them to LAYERS"


def test_no_test_module_is_imported_and_no_arrow_points_up():
    found = violations(graph())
    new = {edge: rule for edge, rule in found.items() if edge not in KNOWN_VIOLATIONS}
    assert not new, "\n".join(f"{a} imports {b}: {rule}" for (a, b), rule in sorted(new.items()))


def test_self_tests_may_import_their_helpers_only():
    """The rules as the self-tests' folders have them: any self-test imports
    ``support/``; no test module is imported, support imports no self-test
    folder, and no other test folder imports ``support/``."""
    harness, tools = "tests.selftest.harness.test_zygote_server", "tests.selftest.tools.test_carry_vllm"
    edges = {
        harness: {"tests.selftest.support.inner", "tests.selftest.support.hostile", tools},
        "tests.selftest.support.inner": {"tests.selftest.support.session_probe", "tests.selftest.harness"},
        "tests.e2e.common": {"tests.selftest.support.inner"},
    }
    assert violations(edges) == {
        (harness, tools): "imports a test module",
        ("tests.selftest.support.inner", "tests.selftest.harness"): "imports another test folder",
        ("tests.e2e.common", "tests.selftest.support.inner"): "imports another test folder",
    }


def test_self_tests_sit_in_a_folder_of_their_kind():
    """docs/developing.md ("Layout"): a self-test goes in a folder of its kind, a helper in support/."""
    loose = sorted(path.name for path in SELFTEST.glob("*.py") if path.name != "__init__.py")
    assert not loose, f"move them into a folder of tests/selftest/ (harness/, checks/, dsv41/, ...): {loose}"
    tests_in_support = sorted(path.name for path in SELFTEST_SUPPORT.glob("test_*.py"))
    assert not tests_in_support, f"support/ holds helpers only: {tests_in_support}"


def test_no_circle_among_dcpcheck_modules():
    found = [circle for circle in circles(graph()) if not _known_circle(circle)]
    assert not found, "\n".join(" <-> ".join(circle) for circle in found)


def test_every_known_violation_still_holds():
    edges = graph()
    found = violations(edges)
    in_circles = {member for circle in circles(edges) for member in circle}
    gone = [
        edge
        for edge in KNOWN_VIOLATIONS
        if edge not in found and not (edge[0] in in_circles and edge[1] in in_circles and edge[1] in edges[edge[0]])
    ]
    assert not gone, f"no longer true, take them out of KNOWN_VIOLATIONS: {gone}"


def _known_circle(circle: list[str]) -> bool:
    return any(a in circle and b in circle for a, b in KNOWN_VIOLATIONS)
