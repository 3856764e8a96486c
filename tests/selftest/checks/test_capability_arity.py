"""A capability that returns the wrong arity fails saying so: the capability,
what was expected and what came back, never an unpacking error.

An inner session runs the stage-3 combine tests over the port with one
defect: ``ag_rs`` returns the bare output where ``(out, lse)`` was asked.
Every call site that unpacks a combine result is reached: the W = 1 path,
the main call, the cross-check of ``a2a`` against ``ag_rs``, the garbage
rows and the precision check.
"""

from __future__ import annotations

import re

import pytest

from dcpcheck.port.impl import EmbeddedPort
from tests.selftest.support.inner import REPO_ROOT, run_inner_pytest

pytestmark = pytest.mark.spawned_only


class BareTensorFromAgRs(EmbeddedPort):
    """The port, except that ``ag_rs`` with ``return_lse=True`` drops the LSE."""

    def combine(self, out, lse, group, *, backend="ag_rs", lse_base=2.0, return_lse=False):
        result = super().combine(out, lse, group, backend=backend, lse_base=lse_base, return_lse=return_lse)
        return result[0] if return_lse and backend == "ag_rs" else result


BARE_TENSOR = "returned Tensor, expected a tuple (out, lse)"
# node id -> what its failure must say
CASES = {
    "tests/stage3_combine/test_combine.py::test_combine_single_rank_returns_inputs[W1-ag_rs]": (
        f"combine(return_lse=True) {BARE_TENSOR}"
    ),
    "tests/stage3_combine/test_combine.py::test_combine_matches_oracle_merge[W2-ag_rs-2-fp32]": (
        f"combine(return_lse=True) {BARE_TENSOR}"
    ),
    "tests/stage3_combine/test_combine.py::test_combine_matches_oracle_merge[W2-a2a-2-fp32]": (
        f"combine(backend='ag_rs', return_lse=True) {BARE_TENSOR}"
    ),
    "tests/stage3_combine/test_mutation_holes.py::test_sentinel_partial_gets_no_weight[W2-ag_rs-2]": (
        f"combine(return_lse=True) {BARE_TENSOR}"
    ),
    "tests/stage3_combine/test_combine_precision.py::test_combine_rounds_once[W2-ag_rs-bf16]": (
        f"combine(return_lse=True) {BARE_TENSOR}"
    ),
}


def failure_sections(output: str) -> dict[str, str]:
    """pytest's failure report, by test name (``test_x[params]``)."""
    parts = re.split(r"^_{3,} (\S+) _{3,}$", output, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def test_a_bare_tensor_where_out_lse_was_asked_fails_naming_the_capability(tmp_path):
    nodes = [str(REPO_ROOT / node) for node in CASES]
    code, output = run_inner_pytest(
        tmp_path, ["--dcp-impl", f"{__name__}:BareTensorFromAgRs", "--world-sizes", "1,2", *nodes]
    )
    assert code == 1, output
    sections = failure_sections(output)
    for node, message in CASES.items():
        name = node.rpartition("::")[2]
        assert name in sections, f"{name} did not fail:\n{output}"
        assert message in sections[name], f"{name} failed without saying {message!r}:\n{sections[name]}"
    assert "to unpack" not in output, output  # no ValueError of unpacking a bare tensor
