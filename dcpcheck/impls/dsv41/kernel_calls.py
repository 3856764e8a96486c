"""Whether the port's call of FlashInfer's SM120 kernel binds to the
installed FlashInfer's signature.

The reference kernel stands in for that call everywhere (no SM120 here), so
the port's own call is never executed; its arguments are read from the
tree's source and FlashInfer's parameters from FlashInfer's source (found on
``sys.path``, not imported: importing FlashInfer needs its CUDA packages).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

PORT_HELPER = "_sm120_sparse_attention_with_lse"  # the seed diff's DCP path into the kernel
KERNEL = "_trtllm_batch_decode_sparse_mla_sm120"
KERNEL_FILE = "mla/_core.py"


def flashinfer_kernel_source() -> Path | None:
    """FlashInfer's ``mla/_core.py`` on ``sys.path``, or None."""
    try:
        spec = importlib.util.find_spec("flashinfer")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / KERNEL_FILE
    return path if path.is_file() else None


def _function(tree: ast.Module, name: str) -> ast.FunctionDef | None:
    return next((node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == name), None)


def _required_and_known(function: ast.FunctionDef) -> tuple[list[str], set[str], bool]:
    """(parameters without a default, every parameter name, takes **kwargs)."""
    arguments = function.args
    positional = arguments.posonlyargs + arguments.args
    without_default = positional[: len(positional) - len(arguments.defaults)]
    required = [arg.arg for arg in without_default]
    required += [arg.arg for arg, default in zip(arguments.kwonlyargs, arguments.kw_defaults) if default is None]
    known = {arg.arg for arg in positional + arguments.kwonlyargs}
    return required, known, arguments.kwarg is not None


def kernel_call_finding(port_file: str, kernel_file: Path) -> str | None:
    """What the port's call of the kernel lacks or passes that the kernel does not take; None if it binds."""
    port_tree = ast.parse(Path(port_file).read_text())
    helper = _function(port_tree, PORT_HELPER)
    if helper is None:
        return f"{port_file} has no {PORT_HELPER}"
    calls = [
        node
        for node in ast.walk(helper)
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == KERNEL
    ]
    if not calls:
        return f"{PORT_HELPER} in {port_file} does not call {KERNEL}"
    kernel = _function(ast.parse(kernel_file.read_text()), KERNEL)
    if kernel is None:
        return f"{kernel_file} has no {KERNEL}"
    required, known, takes_any = _required_and_known(kernel)
    problems = []
    for call in calls:
        passed = {keyword.arg for keyword in call.keywords if keyword.arg}
        covered = set(required[: len(call.args)]) | passed
        missing = [name for name in required if name not in covered]
        unknown = sorted(passed - known) if not takes_any else []
        if missing:
            problems.append(f"it passes no {', '.join(missing)}, which {KERNEL} requires")
        if unknown:
            problems.append(f"it passes {', '.join(unknown)}, which {KERNEL} does not take")
    if not problems:
        return None
    return (
        f"the port's {PORT_HELPER} ({port_file}, line {calls[0].lineno}) calls FlashInfer's {KERNEL} "
        f"({kernel_file}): {'; '.join(problems)}: a TypeError at the first DCP forward on SM120"
    )
