"""The GPU ledger (``dcpcheck/ranks/gpu_ledger.py``): a case holds the GPU memory it declared while it runs, a case
that does not fit beside the holders waits for them in turn, and no dead process, torn file or holder that never
lets go can make a case wait past its limit. Threads and a child process stand in for the workers of a GPU host."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import replace

from dcpcheck.ranks import gpu_ledger
from dcpcheck.ranks.gpu_free import GpuMemory
from dcpcheck.ranks.gpu_ledger import GpuLedger
from dcpcheck.ranks.launcher import Case, CaseResult
from dcpcheck.ranks.placement import Placement
from dcpcheck.ranks.spawned import SpawnedRanks

HOLD_S = 0.6


def _ledger(tmp_path, capacity_gib=68.0) -> GpuLedger:
    return GpuLedger(tmp_path / "ledger.json", capacity_gib)


def _hold_in_thread(ledger, gib, case, seconds, events):
    def body():
        with ledger.hold(gib, case, wait_limit=30.0):
            events.append(("start", case, time.monotonic()))
            time.sleep(seconds)
            events.append(("end", case, time.monotonic()))

    thread = threading.Thread(target=body)
    thread.start()
    return thread


def _times(events, kind, case):
    return next(t for k, c, t in events if k == kind and c == case)


def test_a_case_that_does_not_fit_beside_the_holder_waits_for_it(tmp_path):
    ledger, events = _ledger(tmp_path), []
    first = _hold_in_thread(ledger, 50, "big", HOLD_S, events)
    time.sleep(0.1)
    with ledger.hold(30, "second", wait_limit=30.0) as waited:
        events.append(("start", "second", time.monotonic()))
    first.join()
    assert _times(events, "start", "second") >= _times(events, "end", "big")
    assert waited >= HOLD_S / 2


def test_cases_that_fit_together_run_together(tmp_path):
    ledger, events = _ledger(tmp_path), []
    first = _hold_in_thread(ledger, 30, "a", HOLD_S, events)
    time.sleep(0.1)
    with ledger.hold(30, "b", wait_limit=30.0) as waited:
        pass
    first.join()
    assert waited < HOLD_S / 2


def test_waiters_go_first_come_first_served(tmp_path):
    # A small case that would fit now waits behind an earlier big one, which would otherwise starve.
    ledger, events = _ledger(tmp_path), []
    holder = _hold_in_thread(ledger, 40, "holder", HOLD_S, events)
    time.sleep(0.1)
    big = _hold_in_thread(ledger, 60, "big", 0.1, events)
    time.sleep(0.2)
    assert ledger.someone_waits()
    with ledger.hold(20, "small", wait_limit=30.0):
        events.append(("start", "small", time.monotonic()))
    holder.join()
    big.join()
    assert _times(events, "start", "small") >= _times(events, "start", "big")
    assert not ledger.someone_waits()


def test_a_dead_processs_entry_and_a_torn_file_hold_nothing(tmp_path):
    ledger = _ledger(tmp_path)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = {"pid": int(gone.stdout), "token": "x", "gib": 68, "case": "killed worker"}
    ledger.path.write_text(json.dumps({"held": [dead], "waiting": [dead]}))
    with ledger.hold(60, "next", wait_limit=30.0) as waited:
        assert waited < HOLD_S
    ledger.path.write_text('{"held": [{"pid"')
    with ledger.hold(60, "after a torn write", wait_limit=30.0) as waited:
        assert waited < HOLD_S


def test_a_holder_that_never_lets_go_delays_a_case_by_its_wait_limit_only(tmp_path):
    ledger, events = _ledger(tmp_path), []
    holder = _hold_in_thread(ledger, 60, "stuck", 3.0, events)
    time.sleep(0.1)
    started = time.monotonic()
    with ledger.hold(60, "patient", wait_limit=0.5) as waited:
        assert 0.5 <= waited < 2.0
    assert time.monotonic() - started < 2.0
    holder.join()


class _Pool:
    def __init__(self, ledger, seen):
        self.alive, self.ledger, self.seen = True, ledger, seen

    def run(self, fn, case):
        text = self.ledger.path.read_text()
        self.seen.append(json.loads(text)["held"] if text else [])
        return CaseResult(world_size=case.world_size)

    def kill(self):
        self.alive = False


def _spawned(ledger, pools) -> SpawnedRanks:
    ranks = SpawnedRanks(
        lambda world_size: Placement("cuda", world_size, gpus=1),
        impl_spec="port",
        case_timeout=10.0,
        startup_timeout=10.0,
        gpu_memory=lambda index: GpuMemory(80 * 2**30, 80 * 2**30),
        gpu_ledger=lambda index: ledger,
    )
    ranks.pools = pools
    return ranks


CASE = Case(nodeid="t", stage=None, world_size=2, seed=0, timeout=5.0, params={}, terms=None, header={})


def test_a_marked_case_holds_its_need_while_it_runs_and_an_unmarked_one_nothing(tmp_path):
    ledger, seen = _ledger(tmp_path), []
    ranks = _spawned(ledger, {2: _Pool(ledger, seen)})
    ranks.run(None, replace(CASE, gpu_gib_needed=44.0))
    assert json.loads(ledger.path.read_text())["held"] == []  # let go once the case ended
    ledger.path.write_text("")
    ranks.run(None, CASE)
    assert [[entry["gib"] for entry in held] for held in seen] == [[44.0], []]


def test_a_waiting_case_elsewhere_ends_this_processs_idle_pools(tmp_path):
    # Their ranks' CUDA contexts are memory the waiter may need; the GPU itself is not short here.
    ledger, events = _ledger(tmp_path), []
    holder = _hold_in_thread(ledger, 60, "holder", HOLD_S, events)
    time.sleep(0.1)
    waiter = _hold_in_thread(ledger, 60, "waiter", 0.0, events)
    time.sleep(0.2)
    idle = _Pool(ledger, [])
    ranks = _spawned(ledger, {2: _Pool(ledger, []), 8: idle})
    assert ranks._end_idle_pools_if_gpu_short(CASE) == 1
    assert list(ranks.pools) == [2] and not idle.alive
    holder.join()
    waiter.join()
    assert _spawned(ledger, {2: _Pool(ledger, []), 8: _Pool(ledger, [])})._end_idle_pools_if_gpu_short(CASE) == 0


def test_a_case_that_fits_the_ledger_waits_for_the_gpus_free_memory_a_bounded_time(tmp_path, monkeypatch):
    # Idle pools' contexts and other sessions' unmarked cases hold memory no one declared: wait while the others
    # end their idle pools (someone waits), but not past FREE_WAIT_S.
    monkeypatch.setattr(gpu_ledger, "FREE_WAIT_S", 0.6)
    free = {"gib": 10.0}
    ledger = GpuLedger(tmp_path / "ledger.json", 68.0, lambda: free["gib"])
    seen_waiting = []

    def others_end_their_idle_pools():
        time.sleep(0.3)
        seen_waiting.append(ledger.someone_waits())
        free["gib"] = 50.0

    helper = threading.Thread(target=others_end_their_idle_pools)
    helper.start()
    with ledger.hold(44, "needs 44", wait_limit=30.0) as waited:
        assert 0.3 <= waited < 0.6
    helper.join()
    assert seen_waiting == [True]
    free["gib"] = 10.0
    with ledger.hold(44, "never freed", wait_limit=30.0) as waited:
        assert 0.6 <= waited < 2.0
    with ledger.hold(44, "its pool's contexts counted", wait_limit=30.0, free_needed=8.0) as waited:
        assert waited < 0.3


def _another_process_holds(ledger, gib, seconds, *, waiting=False) -> threading.Thread:
    """A child process's entry in the ledger, held (or waiting first in line) for ``seconds``: the ledger drops
    it once the child is gone, which the returned thread reaps."""
    child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])
    entry = {"pid": child.pid, "token": "other", "gib": gib, "case": "another process's case"}
    text = ledger.path.read_text() if ledger.path.exists() else ""
    entries = json.loads(text) if text else {"held": [], "waiting": []}
    entries["waiting" if waiting else "held"].append(entry)
    ledger.path.write_text(json.dumps(entries))  # no one else writes meanwhile: the holders here sleep
    reaper = threading.Thread(target=child.wait)
    reaper.start()
    return reaper


class _StartedPool:
    """A pool whose start only notes when it happened."""

    def __init__(self, *args, **kwargs):
        self.startup, self.alive = {}, True

    def start(self):
        self.started_at = time.monotonic()

    def kill(self):
        self.alive = False


def test_no_pool_starts_while_another_processs_case_holds_or_awaits_most_of_the_gpu(tmp_path, monkeypatch):
    # Each rank started is a CUDA context the large case's free-memory wait could not see coming.
    monkeypatch.setattr("dcpcheck.ranks.spawned.RankPool", _StartedPool)
    ledger = _ledger(tmp_path)
    for waiting in (False, True):
        began = time.monotonic()
        other = _another_process_holds(ledger, 64, 1.0, waiting=waiting)
        pool = _spawned(ledger, {})._start_pool(2)
        other.join()
        assert pool.started_at - began >= 0.8
        assert pool.startup["gpu_ledger_wait_s"] >= 0.7
    other = _another_process_holds(ledger, 56, 1.0)  # under LARGE_HOLD_SHARE of the 68 GiB
    pool = _spawned(ledger, {})._start_pool(2)
    assert "gpu_ledger_wait_s" not in pool.startup
    other.join()


def test_the_large_case_starts_its_own_ranks_and_a_stuck_one_delays_others_by_the_limit_only(tmp_path):
    ledger, events = _ledger(tmp_path), []
    holder = _hold_in_thread(ledger, 64, "this process's case", HOLD_S, events)
    time.sleep(0.1)
    assert ledger.wait_out_large_holds(limit=10.0) < 0.1
    holder.join()
    other = _another_process_holds(ledger, 64, 3.0)
    assert 0.5 <= ledger.wait_out_large_holds(limit=0.5) < 1.5
    other.join()


def test_a_process_holding_an_entry_does_not_wait_for_a_large_waiter_that_may_wait_for_it(tmp_path):
    ledger, events = _ledger(tmp_path), []
    holder = _hold_in_thread(ledger, 10, "this process's small case", HOLD_S, events)
    time.sleep(0.1)
    other = _another_process_holds(ledger, 64, 3.0, waiting=True)
    assert ledger.someone_waits()
    assert ledger.wait_out_large_holds(limit=10.0) < 0.1
    holder.join()
    other.join()
