"""Many inner pytest sessions in one interpreter: ``python -m
tests.selftest.support.session_probe CASES.json`` runs ``pytest.main`` (what the
``pytest`` command runs) once per case, with the case's environment, and
writes every run's exit code and output as JSON to the file named by
``DCPCHECK_SESSION_PROBE_RESULTS``. One interpreter start
instead of one per session, for the sessions that need no process of their
own (usage errors, skips, gating)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import pytest

RESULTS_ENV = "DCPCHECK_SESSION_PROBE_RESULTS"  # the file the results are written to (JSON)


def run_case(args: list[str], env: dict[str, str]) -> dict:
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            code = pytest.main(["-p", "no:cacheprovider", "-q", *args])
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return {"code": int(code), "output": output.getvalue()}


def main() -> int:
    with open(sys.argv[1]) as fh:
        cases = json.load(fh)
    results = [run_case(case["args"], case.get("env", {})) for case in cases]
    with open(os.environ[RESULTS_ENV], "w") as fh:
        json.dump(results, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
