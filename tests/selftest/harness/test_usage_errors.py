"""Every bad option value and every broken ``--dcp-impl`` is a usage error:
exit code 4, one line saying what was wrong and what is accepted, no
traceback; never an INTERNALERROR, nor a run that checks nothing and passes."""

from __future__ import annotations

import pytest

from tests.selftest.support.inner import run_sessions_in_one_interpreter, write_session
from tests.selftest.support.session_sources import MULTI_RANK_TESTS

pytestmark = pytest.mark.spawned_only

RAISING_ATTRIBUTES_IMPL = """
from dcpcheck.impls.conventions import Conventions


class Readable:
    name = "readable"

    def filter_index(self, *args, **kwargs):
        pass


class RaisingCombine(Readable):
    @property
    def combine(self):
        raise RuntimeError("combine is built on first use")


class RaisingFilterIndex:  # the only capability: read while the implementation loads
    @property
    def filter_index(self):
        raise RuntimeError("filter_index is built on first use")


class RaisingName(Readable):
    @property
    def name(self):
        raise RuntimeError("no name before the model loads")


class LateConventions:
    def __getattr__(self, field):  # the defaults, but for the one below
        return getattr(Conventions(), field)

    @property
    def filter_takes_ratio(self):
        raise RuntimeError("the ratio is known once the model loads")


class RaisingConvention(Readable):
    conventions = LateConventions()
"""

BROKEN_IMPLS = {
    "raising_attributes.py": RAISING_ATTRIBUTES_IMPL,
    "syntax_error.py": "class Impl:\n    def combine(self\n",
    "raises_at_import.py": "raise RuntimeError('no licence server')\n",
    "raising_constructor.py": (
        "class Impl:\n    def __init__(self):\n        raise ValueError('needs a GPU')\n"
        "    def combine(self, *a, **k):\n        pass\n"
    ),
}

# (bad input, argv, environment, what the one line must say)
CASES = [
    ("impl file with a syntax error", ["--dcp-impl", "syntax_error.py:Impl"], {}, "raised SyntaxError"),
    (
        "impl module raising at import",
        ["--dcp-impl", "raises_at_import.py:Impl"],
        {},
        "raised RuntimeError: no licence server",
    ),
    (
        "impl module raising at import, by name",
        ["--dcp-impl", "raises_at_import:Impl"],
        {},
        "raised RuntimeError: no licence server",
    ),
    (
        "impl constructor raising",
        ["--dcp-impl", "raising_constructor.py:Impl"],
        {},
        "calling Impl() raised ValueError: needs a GPU",
    ),
    (
        "capability property raising",
        ["--dcp-impl", "raising_attributes.py:RaisingCombine"],
        {},
        "reading its `combine` raised RuntimeError: combine is built on first use",
    ),
    (
        "only capability property raising",
        ["--dcp-impl", "raising_attributes.py:RaisingFilterIndex"],
        {},
        "raised RuntimeError: filter_index is built on first use (in filter_index, raising_attributes.py:",
    ),
    (
        "name property raising",
        ["--dcp-impl", "raising_attributes.py:RaisingName"],
        {},
        "reading its `name` raised RuntimeError: no name before the model loads",
    ),
    (
        "convention property raising",
        ["--dcp-impl", "raising_attributes.py:RaisingConvention"],
        {},
        "reading its `conventions.filter_takes_ratio` raised RuntimeError: the ratio is known once the model loads",
    ),
    ("superscript stage digit", [], {"DSV41_DCP_STAGE": "³"}, "DSV41_DCP_STAGE='³' is not a stage"),
    ("arabic-indic stage digit", [], {"DSV41_DCP_STAGE": "٣"}, "DSV41_DCP_STAGE='٣' is not a stage"),
    ("timeout nan", ["--dcp-timeout", "nan"], {}, "--dcp-timeout nan: expected a finite number of seconds above 0"),
    ("timeout inf", ["--dcp-timeout", "inf"], {}, "--dcp-timeout inf: expected a finite number"),
    ("timeout 0", ["--dcp-timeout", "0"], {}, "--dcp-timeout 0: expected a finite number"),
    ("timeout -1", ["--dcp-timeout", "-1"], {}, "--dcp-timeout -1: expected a finite number"),
    # Past what the platform can wait (threading.TIMEOUT_MAX, a C int of days).
    (
        "timeout 1e10",
        ["--dcp-timeout", "1e10"],
        {},
        "--dcp-timeout 1e+10: expected a finite number of seconds above 0 and at most 1e+06",
    ),
    (
        "timeout 1e300",
        ["--dcp-timeout", "1e300"],
        {},
        "--dcp-timeout 1e+300: expected a finite number of seconds above 0 and at most 1e+06",
    ),
    (
        "startup timeout 1e300",
        ["--dcp-startup-timeout", "1e300"],
        {},
        "--dcp-startup-timeout 1e+300: expected a finite number of seconds above 0 and at most 1e+06",
    ),
    ("startup timeout 0", ["--dcp-startup-timeout", "0"], {}, "--dcp-startup-timeout 0: expected a finite number"),
    ("startup timeout -1", ["--dcp-startup-timeout", "-1"], {}, "--dcp-startup-timeout -1: expected a finite number"),
    (
        "startup timeout nan",
        ["--dcp-startup-timeout", "nan"],
        {},
        "--dcp-startup-timeout nan: expected a finite number",
    ),
    (
        "world size 3",
        ["--world-sizes", "3"],
        {},
        "--world-sizes 3: no collected test supports W=3; supported world sizes: 1, 2, 4, 8",
    ),
    (
        "world size 16",
        ["--world-sizes", "2,16"],
        {},
        "--world-sizes 2,16: no collected test supports W=16; supported world sizes: 1, 2, 4, 8",
    ),
]


@pytest.fixture(scope="module")
def probe_results(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("usage")
    write_session(tmp_path, {"test_multi.py": MULTI_RANK_TESTS, **BROKEN_IMPLS})
    return run_sessions_in_one_interpreter(
        tmp_path, {name: ([*argv, "test_multi.py"], env) for name, argv, env, _ in CASES}, timeout=120
    )


@pytest.mark.parametrize(
    "name, expected", [(name, expected) for name, _, _, expected in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_is_a_one_line_usage_error(probe_results, name, expected):
    code, output = probe_results[name]
    assert code == 4, output
    assert "Traceback" not in output and "INTERNALERROR" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 1 and expected in errors[0], output
    if "--dcp-impl" in output:
        assert "accepted:" in errors[0] or "no arguments" in errors[0], output
