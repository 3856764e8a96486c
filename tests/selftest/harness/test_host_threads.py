"""Processes on a GPU host share its cores: a rank gets its share of threads and its idle OpenMP threads sleep
(dcpcheck/ranks/host_threads.py); a value the user set is kept."""

from __future__ import annotations

import os

import pytest

from dcpcheck.ranks.host_threads import IDLE_THREADS_SLEEP, WAIT_POLICY_VARIABLE, share_host_cores


@pytest.mark.parametrize("processes", [1, 3, 1000])
def test_a_process_gets_its_share_of_the_cores_and_sleeping_idle_threads(processes):
    env = share_host_cores({}, processes=processes)
    assert env == {
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // processes)),
        WAIT_POLICY_VARIABLE: IDLE_THREADS_SLEEP,
    }


def test_what_the_user_set_is_kept():
    mine = {"OMP_NUM_THREADS": "7", WAIT_POLICY_VARIABLE: "ACTIVE"}
    assert share_host_cores(dict(mine), processes=2) == mine
