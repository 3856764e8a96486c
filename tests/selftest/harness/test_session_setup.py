"""Usage errors, stage gating and capability skips, seen from a real inner
pytest session (they happen at configure and collection time)."""

from __future__ import annotations

import re
import time

import pytest

from tests.selftest.support.inner import run_inner_pytest, run_sessions_in_one_interpreter, write_session

pytestmark = pytest.mark.spawned_only

STAGED_TESTS = """
import pytest

@pytest.mark.stage(1)
def test_stage_one():
    pass

@pytest.mark.stage(3)
def test_stage_three():
    pass

@pytest.mark.needs("no_such_capability")
def test_needs_missing_capability():
    pass
"""


KNOWN_DEFECT_IMPL = """
import math

import torch

from dcpcheck.impls.protocol import KnownFailure


class WithKnownDefect:
    name = "defective"

    def combine(self, *args, **kwargs):
        raise NotImplementedError

    def unavailable_reason(self, terms):
        if terms.lse_base == math.e and terms.dtype == torch.bfloat16 and terms.head_dim == 72:
            return "no base-e bf16 kernel at D=72 here"
        return None

    def known_defect(self, terms):
        if "combine" in terms.capabilities and terms.world_size == 2 and terms.backend == "a2a":
            return KnownFailure("rank 0 always fails (vendor bug 123)", shows=r"rank \\d failed")
        if "combine" in terms.capabilities and terms.backend == "ag_rs":
            return KnownFailure("rank 0's LSE is off (vendor bug 456)", shows="LSE of rank 0 is off")
        if "short_table" in terms.properties:  # fixed since: the case passes, an XPASS and no failure
            return KnownFailure("was broken before release 2", shows="short table")
        return None
"""

KNOWN_DEFECT_TESTS = """
import pytest

pytestmark = pytest.mark.world_sizes(2)

def fails_on_rank_zero(ctx, *, backend):
    assert ctx.rank != 0, "rank 0 failed"

def passes(ctx, **case):
    pass

@pytest.mark.needs("combine")
def test_known_defect(dcp):
    dcp.run(fails_on_rank_zero, backend="a2a")

@pytest.mark.needs("combine")
def test_another_failure_under_a_known_defect(dcp):
    dcp.run(fails_on_rank_zero, backend="ag_rs")  # not the failure its defect shows

@pytest.mark.scenario("short_table")
def test_fixed_defect(dcp):
    dcp.run(passes)

def test_no_defect(dcp):
    dcp.run(passes, backend="a2a")  # the case does not call combine

def test_unavailable_case(dcp):
    dcp.run(passes, lse_base="e", dtype_name="bf16", head_dim=72)

def test_available_case(dcp):
    dcp.run(passes, lse_base="2", dtype_name="bf16", head_dim=72)
"""


FAILS_TO_JOIN_IMPL = """
import sys

import torch.distributed as dist

if "dcpcheck/ranks/" in sys.argv[0]:  # in the pool's processes only (its zygote server, or a rank)

    def refuse(*args, **kwargs):
        raise RuntimeError("planted: no process group today")

    dist.init_process_group = refuse  # every rank fails while it starts


class FailsToJoin:
    name = "fails-to-join"

    def combine(self, *args, **kwargs):
        raise NotImplementedError
"""

ONE_W2_CASE_TESTS = """
def passes(ctx):
    pass

def test_one_case(dcp):
    dcp.run(passes)
"""

CHANGES_INPUTS_IMPL = """
from dcpcheck.port.impl import EmbeddedPort


class ChangesInputs(EmbeddedPort):
    name = "changes-inputs"

    @staticmethod
    def combine(out, lse, group, **options):
        result = EmbeddedPort.combine(out, lse, group, **options)
        if group.rank_in_group == 1:
            lse.view(-1)[:37] += 1.0  # after the merge: only the check of its inputs can tell
        return result

    @staticmethod
    def filter_index(topk, token_to_req, block_table, is_valid_token, **options):
        result = EmbeddedPort.filter_index(topk, token_to_req, block_table, is_valid_token, **options)
        block_table[0, 0] = 99
        return result

    def known_defect(self, terms):
        if "lse_near_150" in terms.properties:
            raise ValueError("planted: known_defect raises")
        return None
"""

CHANGES_INPUTS_TESTS = """
import pytest
import torch

pytestmark = pytest.mark.world_sizes(2)

def calls_combine(ctx):
    out, lse = torch.zeros(20, 8, 4), torch.zeros(20, 8)
    ctx.impl.combine(out, lse, ctx.group, backend="ag_rs", lse_base=2.0, return_lse=True)

def calls_filter_index(ctx):
    topk = torch.tensor([[0, 1, 2, -1]], dtype=torch.int32)
    table = torch.arange(8, dtype=torch.int32).reshape(1, 8)
    ctx.impl.filter_index(
        topk, torch.zeros(1, dtype=torch.int32), table, torch.ones(1, dtype=torch.bool),
        bs=4, world_size=ctx.world_size, rank=ctx.rank, interleave=1,
    )

def test_combine_changes_lse(dcp):
    dcp.run(calls_combine)

def test_filter_index_changes_the_block_table(dcp):
    dcp.run(calls_filter_index)

@pytest.mark.scenario("lse_near_150")
def test_known_defect_raises(dcp):
    dcp.run(calls_combine)
"""


USER_IMPL_LACKING_CAPABILITIES = (
    "class Partial:\n    name = 'mine'\n    def filter_index(self, *a, **k):\n        raise NotImplementedError\n"
)
NEEDS_COMBINE_TESTS = '@__import__("pytest").mark.needs("combine")\ndef test_combine():\n    pass\n'
SCENARIO_TYPO_TESTS = 'import pytest\n\n@pytest.mark.scenario("short_tables")\ndef test_x(dcp):\n    pass\n'
BAD_STAGE_VALUES = ["abc", "-1", "2.5", "three"]

# name -> (pytest arguments, environment) of the sessions that need no process of their own.
SESSIONS = {
    **{f"stage {raw}": (["test_staged.py"], {"DSV41_DCP_STAGE": raw}) for raw in BAD_STAGE_VALUES},
    "unknown impl": (["--dcp-impl", "nonsense", "test_staged.py"], {}),
    "missing user module": (["--dcp-impl", "no_such_pkg.mod:impl", "test_staged.py"], {}),
    "bad world sizes": (["--world-sizes", "2,x", "test_staged.py"], {}),
    "stage 1": (["-rs", "test_staged.py"], {"DSV41_DCP_STAGE": "1"}),
    "stage empty": (["test_staged.py"], {"DSV41_DCP_STAGE": ""}),
    "user impl lacking capabilities": (["-rs", "--dcp-impl", "my_impl.py:Partial", "test_mine.py"], {}),
    "known defects": (
        # The longest timeouts accepted: the pool, the collectives and the wait for known_defect take them.
        ["-rsxX", "--dcp-impl", "defective.py:WithKnownDefect", "--world-sizes", "2", "test_defect.py"]
        + ["--dcp-timeout", "1e6", "--dcp-startup-timeout", "1e6"],
        {},
    ),
    "ranks fail to start": (
        ["--device", "cpu", "--dcp-impl", "fails_to_join.py:FailsToJoin", "--world-sizes", "2", "test_one_w2.py"],
        {},
    ),
    "inputs changed in place": (
        ["--dcp-impl", "changes_inputs.py:ChangesInputs", "--world-sizes", "2", "test_changes_inputs.py"],
        {},
    ),
    "scenario typo": (["test_typo.py"], {}),
}


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("sessions")
    files = {
        "test_staged.py": STAGED_TESTS,
        "my_impl.py": USER_IMPL_LACKING_CAPABILITIES,
        "test_mine.py": NEEDS_COMBINE_TESTS,
        "defective.py": KNOWN_DEFECT_IMPL,
        "test_defect.py": KNOWN_DEFECT_TESTS,
        "test_typo.py": SCENARIO_TYPO_TESTS,
        "fails_to_join.py": FAILS_TO_JOIN_IMPL,
        "test_one_w2.py": ONE_W2_CASE_TESTS,
        "changes_inputs.py": CHANGES_INPUTS_IMPL,
        "test_changes_inputs.py": CHANGES_INPUTS_TESTS,
    }
    write_session(tmp_path, files)
    return run_sessions_in_one_interpreter(tmp_path, SESSIONS)


@pytest.mark.parametrize("raw", BAD_STAGE_VALUES)
def test_bad_stage_value_is_a_usage_error(sessions, raw):
    code, output = sessions[f"stage {raw}"]
    assert code == 4, output
    assert f"DSV41_DCP_STAGE={raw!r} is not a stage" in output
    assert "non-negative integer" in output and "unset" in output


def test_unknown_impl_is_a_usage_error_listing_the_choices(sessions):
    code, output = sessions["unknown impl"]
    assert code == 4, output
    assert "--dcp-impl 'nonsense' is not recognised" in output
    assert "'port'" in output and "'vllm'" in output and "pkg.module:attr" in output


def test_missing_user_module_is_a_usage_error(sessions):
    code, output = sessions["missing user module"]
    assert code == 4, output
    assert "cannot import module 'no_such_pkg.mod'" in output


def test_bad_world_sizes_is_a_usage_error(sessions):
    code, output = sessions["bad world sizes"]
    assert code == 4, output
    assert "--world-sizes '2,x'" in output


def test_stage_gate_skips_later_stages_naming_the_variable(sessions):
    code, output = sessions["stage 1"]
    assert code == 0, output
    assert "1 passed, 2 skipped" in output
    assert "DSV41_DCP_STAGE=1: stage 3 (partial attention + LSE combine) is not reached yet" in output
    assert "implementation 'port' lacks capability no_such_capability" in output


def test_unset_stage_runs_every_stage(sessions):
    code, output = sessions["stage empty"]
    assert code == 0, output
    assert "2 passed, 1 skipped" in output


def test_user_implementation_from_a_file_lacking_capabilities_skips(sessions):
    code, output = sessions["user impl lacking capabilities"]
    assert code == 0, output
    assert "implementation 'my_impl.py:Partial' lacks capability combine" in output


def test_known_defects_are_expected_failures_that_still_run(sessions):
    code, output = sessions["known defects"]
    assert code == 1, output  # the case that failed otherwise than its known defect shows
    assert "1 failed, 2 passed" in output and "1 skipped" in output, output
    assert "1 xfailed" in output and "1 xpassed" in output, output
    assert "known defect of defective.py:WithKnownDefect: rank 0 always fails (vendor bug 123)" in output


def test_a_known_defect_does_not_mask_another_failure(sessions):
    _, output = sessions["known defects"]
    assert re.search(r"_ test_another_failure_under_a_known_defect\[W2\] _", output), output
    assert "not the known defect: known defect of defective.py:WithKnownDefect: rank 0's LSE is off" in output
    assert (
        "that defect fails a case showing /LSE of rank 0 is off/ in each comparison that fails; this failure does not"
        in output
    )
    assert "rank 0 failed" in output  # the failure itself follows
    assert "no base-e bf16 kernel at D=72 here" in output


def test_unknown_scenario_property_is_a_usage_error(sessions):
    code, output = sessions["scenario typo"]
    assert code == 4, output
    assert "unknown scenario properties ['short_tables']" in output and "'short_table'" in output


def test_a_rank_failing_while_it_starts_is_reported_with_its_own_error(sessions):
    code, output = sessions["ranks fail to start"]
    assert code == 1 and "1 failed" in output, output
    found = re.search(r"could not start 2 ranks \(cpu/gloo; ready phase\) after ([0-9.]+) s: rank \d failed", output)
    assert found and float(found.group(1)) < 30, output  # the real elapsed time, not the start-up timeout
    assert "RuntimeError: planted: no process group today" in output
    assert "timed out" not in output
    # Printed once in the failure, not once more as a chained exception; pytest's
    # short summary repeats the message in full where it runs on CI (CI set).
    report = output.split("short test summary info")[0]
    assert report.count("could not start 2 ranks") == 1, output
    assert "During handling of the above exception" not in output


def test_inputs_changed_in_place_are_named(sessions):
    code, output = sessions["inputs changed in place"]
    assert code == 1 and "3 failed" in output, output
    assert "failing ranks [1]; ranks [0] passed" in output
    assert "[rank 1] InputChangedError: combine changed its input `lse` in place (rank 1, 37 of 160 elements)" in output
    assert "filter_index changed its input `block_table` in place (rank 0, 1 of 8 elements)" in output
    assert "its contract says it only reads its inputs" in output
    assert "known_defect(terms) raised ValueError: planted: known_defect raises" in output


BROKEN_AT_FORK_IMPL = """
import os
import sys
import time


def _die_if_a_rank():
    if "dcpcheck/ranks/worker" in sys.argv[0]:  # forked by the pool's zygote: a rank
        os._exit(9)


if "dcpcheck/ranks/" in sys.argv[0]:  # in the pool's processes only (its zygote server, or a rank)
    os.register_at_fork(after_in_child=_die_if_a_rank)  # every rank dies as it starts


class BrokenAtFork:
    name = "broken"

    def combine(self, *args, **kwargs):
        raise NotImplementedError

    def unavailable_reason(self, terms):
        if terms.backend == "a2a":
            time.sleep(3600)
        return None
"""

BROKEN_AT_FORK_TESTS = """
def passes(ctx, **case):
    pass

def test_a_hanging_question(dcp):
    dcp.run(passes, backend="a2a")

def test_b_ranks_die_at_start(dcp):
    dcp.run(passes)

def test_c_not_tried_again(dcp):
    dcp.run(passes)
"""


def test_hung_question_and_dying_pool_fail_fast(tmp_path):
    write_session(tmp_path, {"broken.py": BROKEN_AT_FORK_IMPL, "test_broken.py": BROKEN_AT_FORK_TESTS})
    started = time.perf_counter()
    code, output = run_inner_pytest(
        tmp_path,
        [
            "--device",
            "cpu",
            "--dcp-impl",
            "broken.py:BrokenAtFork",
            "--world-sizes",
            "2",
            "-k",
            "W2",
            "--dcp-timeout",
            "2",
        ],
    )
    assert code == 1 and "3 failed" in output, output
    assert "broken.py:BrokenAtFork.unavailable_reason(terms) did not return within 2 s" in output
    assert "time.sleep(3600)" in output  # its stack
    assert "could not start 2 ranks (cpu/gloo" in output and "exited with code 9" in output, output
    assert "timed out after" not in output
    assert "not tried again: the pool of 2 ranks failed to start earlier in this session" in output
    assert time.perf_counter() - started < 60
