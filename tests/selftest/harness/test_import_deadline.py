"""An implementation whose import never returns (a tree whose
``vllm/__init__.py`` waits forever) is bounded like a pool's start: a
one-line usage error naming the module being imported and its stack, exit
code 4, within ``--dcp-startup-timeout``; pytest never hangs in configure."""

from __future__ import annotations

import time

import pytest

from tests.selftest.support.inner import run_inner_pytest, write_session

pytestmark = pytest.mark.spawned_only

SLEEPS_AT_IMPORT = "import time\n\ntime.sleep(10**6)  # what a hung import looks like\n"


def test_an_import_that_never_returns_is_a_usage_error_naming_it(tmp_path):
    write_session(tmp_path, {"test_nothing.py": "def test_nothing():\n    pass\n"})
    (tmp_path / "hangs").mkdir()
    (tmp_path / "hangs" / "__init__.py").write_text(SLEEPS_AT_IMPORT)
    (tmp_path / "hangs" / "impl.py").write_text("class Impl:\n    def combine(self, *args):\n        pass\n")
    started = time.perf_counter()
    code, output = run_inner_pytest(
        tmp_path, ["--dcp-impl", "hangs.impl:Impl", "--dcp-startup-timeout", "3", "test_nothing.py"], timeout=60
    )
    assert code == 4, output
    error = [line for line in output.splitlines() if line.startswith("ERROR:")]
    assert len(error) == 1, output
    assert "--dcp-impl hangs.impl:Impl: loading it did not end within 3 s (--dcp-startup-timeout)" in error[0]
    assert "stuck importing module 'hangs'" in error[0] and "time.sleep(10**6)" in error[0], output
    assert time.perf_counter() - started < 45
