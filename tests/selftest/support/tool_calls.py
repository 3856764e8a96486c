"""Run one tool's ``main(argv)`` for many argument lists in one process, as
its command line would: what each call wrote to stdout and stderr, and its
exit status (a traceback in stderr and status 1 where it raised).

    python tests/selftest/support/tool_calls.py tools/gpu_ci.py < argvs.json > answers.json

A process per argument list imports the tool (and torch) once per list; the
usage-error self-tests ask dozens. Standard library only: it also runs under
``python -S`` (no site-packages).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
import traceback
from pathlib import Path


def call(tool: Path, main, argv: list[str]) -> dict:
    sys.argv = [str(tool), *argv]  # argparse names the program after it
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            status = main(argv)
        except SystemExit as exit_:
            status = exit_.code
        except BaseException:  # noqa: BLE001  (a tool that raises is what the caller checks for)
            traceback.print_exc()
            status = 1
    status = 0 if status is None else status if isinstance(status, int) else 1
    return {"status": status, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}


def main() -> None:
    tool = Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(tool.parent))
    spec = importlib.util.spec_from_file_location(tool.stem, tool)
    module = importlib.util.module_from_spec(spec)
    sys.modules[tool.stem] = module
    spec.loader.exec_module(module)
    argvs = json.load(sys.stdin)
    json.dump([call(tool, module.main, argv) for argv in argvs], sys.stdout)


if __name__ == "__main__":
    main()
