"""How a mutant's buggy copy differs from the port function it replaces.

The port is still changing under its mutants; a copy made from an older
version would carry that version's differences as extra, unintended changes.
:func:`copy_hunks` compares the two functions statement by statement (AST,
so comments, docstrings, decorators, annotations and the function's name
do not count):
a faithful mutant differs in exactly one hunk (or one moved statement):
its bug.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import textwrap
import types

from dcpcheck.mutants.rebind import python_function


def _statements(fn: types.FunctionType) -> list[str]:
    node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    node.decorator_list = []
    node.name = "_"
    node.returns = None
    for arg in ast.walk(node.args):
        if isinstance(arg, ast.arg):
            arg.annotation = None
    if ast.get_docstring(node) is not None:
        node.body = node.body[1:]
    return ast.unparse(node).splitlines()


def copy_hunks(original, copy) -> list[list[str]]:
    """The changed hunks between two functions, each as ``-``/``+`` lines; a
    statement moved elsewhere (deleted here, inserted there) is one hunk."""
    before, after = _statements(python_function(original)), _statements(python_function(copy))
    matcher = difflib.SequenceMatcher(None, before, after, autojunk=False)
    hunks = [
        [f"- {line.strip()}" for line in before[i1:i2]] + [f"+ {line.strip()}" for line in after[j1:j2]]
        for tag, i1, i2, j1, j2 in matcher.get_opcodes()
        if tag != "equal"
    ]
    if len(hunks) == 2 and sorted(line[2:] for line in hunks[0]) == sorted(line[2:] for line in hunks[1]):
        return [hunks[0] + hunks[1]]
    return hunks
