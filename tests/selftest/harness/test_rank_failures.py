"""A failing, stuck or killed rank fails its test clearly, within its timeout,
and the next test runs on a fresh pool."""

from __future__ import annotations

import time

import pytest
import torch

from tests.selftest.support.hostile import (
    change_global_state,
    change_state_between_cases,
    change_the_group,
    exit_after_reporting,
    exit_on_the_next_task,
    global_state_seen,
    group_seen,
    raise_monsters,
    report_then_exit,
    stop_myself,
)
from tests.selftest.support.rank_functions import (
    group_collectives_match_torch,
    kill_rank,
    raise_on_rank,
    skip_collective_on_rank,
    sum_of_ranks,
)

SHORT_TIMEOUT_S = 2.0
# Stacks, killing and reporting on top of the timeout itself.
REPORT_SLACK_S = 6.0


def _failure_message(dcp, fn, **case) -> tuple[str, float]:
    started = time.perf_counter()
    with pytest.raises(pytest.fail.Exception) as info:
        dcp.run(fn, timeout=SHORT_TIMEOUT_S, **case)
    return str(info.value), time.perf_counter() - started


def test_all_ranks_pass_and_return_their_values(dcp):
    values = dcp.run(sum_of_ranks)
    assert values == [dcp.world_size * (dcp.world_size + 1) / 2] * dcp.world_size


@pytest.mark.spawned_only
@pytest.mark.world_sizes(2, 4)
def test_exception_on_one_rank_after_collectives_names_that_rank(dcp):
    message, _ = _failure_message(dcp, raise_on_rank, bad_rank=1, before_collective=False)
    assert "failing ranks [1]" in message
    assert "[rank 1] ValueError: planted failure on rank 1" in message
    assert "raise_on_rank" in message  # the traceback, not just the message
    assert f"W={dcp.world_size}" in message and "seed=" in message
    assert dcp.run(sum_of_ranks)  # the pool is still usable


@pytest.mark.spawned_only
@pytest.mark.world_sizes(2, 4)
def test_exception_before_a_collective_does_not_hang_the_peers(dcp):
    message, seconds = _failure_message(dcp, raise_on_rank, bad_rank=1, before_collective=True)
    assert "failing ranks [1]" in message
    assert "did not finish: still running after a peer failed" in message
    assert "Python stacks" in message
    assert seconds < SHORT_TIMEOUT_S + REPORT_SLACK_S
    assert dcp.run(sum_of_ranks)


@pytest.mark.spawned_only
@pytest.mark.world_sizes(2)
def test_rank_that_skips_a_collective_times_out_with_stacks(dcp):
    message, seconds = _failure_message(dcp, skip_collective_on_rank, bad_rank=1)
    assert f"ranks [0] did not finish: timed out after {SHORT_TIMEOUT_S:g} s" in message
    assert "[rank 0] Python stacks at the timeout" in message
    assert "sum_of_ranks" in message
    if dcp.device_type == "cpu":  # gloo blocks inside all_reduce; NCCL returns and blocks at .item()
        assert "all_reduce" in message
    assert SHORT_TIMEOUT_S <= seconds < SHORT_TIMEOUT_S + REPORT_SLACK_S


@pytest.mark.spawned_only
@pytest.mark.world_sizes(2)
def test_next_case_after_a_timeout_passes(dcp):
    _failure_message(dcp, skip_collective_on_rank, bad_rank=0)
    assert dcp.run(sum_of_ranks) == [3.0, 3.0]


@pytest.mark.spawned_only
@pytest.mark.world_sizes(2, 4)
def test_killed_worker_is_reported_as_killed(dcp):
    message, seconds = _failure_message(dcp, kill_rank, bad_rank=dcp.world_size - 1)
    assert f"[rank {dcp.world_size - 1}] worker died: killed by signal SIGKILL (9)" in message
    assert seconds < SHORT_TIMEOUT_S + REPORT_SLACK_S
    assert dcp.run(sum_of_ranks)


def test_group_collectives_are_rank_ordered(dcp):
    dcp.run(group_collectives_match_torch)


@pytest.mark.world_sizes(1, 2)
def test_case_that_changes_global_state_fails_and_the_next_starts_clean(dcp):
    message, _ = _failure_message(dcp, change_global_state)
    assert f"failing ranks {list(range(dcp.world_size))}" in message
    assert "[rank 0] LeakedStateError" in message
    assert "default dtype torch.float32 -> torch.float64" in message and "grad mode True -> False" in message
    first, again = dcp.run(global_state_seen), dcp.run(global_state_seen)
    assert first[0][:3] == (torch.float32, True, None)  # undone / put back
    assert first == again  # the global RNG is seeded from the case's seed, not left where the last case left it


@pytest.mark.world_sizes(2)
def test_case_that_changes_its_group_fails_naming_it_and_the_next_finds_the_group_as_it_was(dcp):
    message, _ = _failure_message(dcp, change_the_group)
    assert "failing ranks [0, 1]" in message and "[rank 1] LeakedStateError" in message, message
    for change in ("group.cpu_group deleted", "group.rank_in_group 1 -> 6", "group.world_size 2 -> 1"):
        assert change in message, message
    assert dcp.run(group_seen) == [(0, 2), (1, 2)]


@pytest.mark.spawned_only
@pytest.mark.world_sizes(2)
def test_state_changed_between_cases_fails_the_next_naming_the_case_that_leaked_it(dcp, request):
    assert dcp.run(change_state_between_cases) == [None, None]  # nothing changed while it ran
    message, _ = _failure_message(dcp, sum_of_ranks)
    assert "failing ranks [0, 1]" in message, message
    assert (
        f"[rank 1] LeakedStateError: process-wide state changed after the previous case on these ranks "
        f"({request.node.nodeid}) ended, before this one began" in message
    ), message
    for change in (
        "default device cpu -> meta",
        "group.world_size 2 -> 1",
        "warnings filters added 'error' for Warning",
    ):
        assert change in message, message
    assert f"{request.node.nodeid} leaked it, not this case" in message, message
    assert "Warning" not in message.split("LeakedStateError")[0], message  # the case itself ran on the known state
    assert dcp.run(group_seen) == [(0, 2), (1, 2)]


@pytest.mark.world_sizes(2)
def test_monstrous_exceptions_are_reported_bounded(dcp):
    message, _ = _failure_message(dcp, raise_monsters, kind="huge")
    assert "[rank 1] ValueError: xxx" in message and "characters cut" in message
    assert len(message) < 300_000  # 64 KB per rank's error, and what frames it
    message, _ = _failure_message(dcp, raise_monsters, kind="str raises")
    assert "[rank 1] MonstrousError: <str() of the exception raised RuntimeError>" in message
    message, _ = _failure_message(dcp, raise_monsters, kind="SystemExit(0)")
    assert "[rank 1] SystemExit: 0 (the rank function left the case early by raising SystemExit)" in message
    assert "exited with code" not in message
    assert dcp.run(sum_of_ranks)


@pytest.mark.spawned_only
@pytest.mark.world_sizes(2)
def test_stopped_rank_is_reported_as_stopped(dcp):
    message, seconds = _failure_message(dcp, stop_myself, bad_rank=1)
    assert "[rank 1] Python stacks at the timeout:\n(no stack: the process (pid" in message
    assert "is stopped (SIGSTOP or SIGTSTP)" in message
    assert seconds < SHORT_TIMEOUT_S + REPORT_SLACK_S
    assert dcp.run(sum_of_ranks)


@pytest.mark.spawned_only
@pytest.mark.world_sizes(2)
def test_a_rank_that_exits_after_reporting_keeps_its_result_and_the_next_case_runs(dcp):
    assert dcp.run(report_then_exit, bad_rank=1) == [0, 1]
    assert dcp.run(sum_of_ranks)  # on a fresh pool: rank 1 is gone


@pytest.mark.spawned_only
@pytest.mark.world_sizes(2)
def test_a_rank_that_dies_between_cases_costs_the_next_case_nothing(dcp):
    # Gone before the next task was sent, then as it arrived: either way the
    # next case runs on a fresh pool, with no BrokenPipeError and no false "dead ranks".
    for dies_between_cases in (exit_after_reporting, exit_on_the_next_task):
        assert dcp.run(dies_between_cases, bad_rank=1) == [0, 1]
        assert dcp.run(sum_of_ranks) == [3.0, 3.0], dies_between_cases.__name__
