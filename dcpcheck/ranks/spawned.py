"""Spawned ranks for plain ``pytest``: one persistent pool per world size, and
the one owner of each pool's life cycle.

A pool is started by the first case of its world size and reused by the next
ones; a case that leaves ranks stuck or dead gets the pool killed (its process
group is broken), so the next case of that world size starts a fresh one, as
it does when a rank died between cases; :meth:`SpawnedRanks.stop` ends every
pool at the end of the session, then the zygote servers the pools were
forked from.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from contextlib import ExitStack

from dcpcheck.ranks.gpu_free import GpuMemory, gpu_memory
from dcpcheck.ranks.gpu_ledger import CUDA_CONTEXT_GIB, GpuLedger, host_ledger
from dcpcheck.ranks.launcher import COLLECTIVE_TIMEOUT_GRACE_S, Case, CaseResult, LaunchError
from dcpcheck.ranks.placement import Placement
from dcpcheck.ranks.pool import PoolOutOfMemory, RankGoneBeforeCase, RankPool
from dcpcheck.ranks.zygote_server import ImplInitialisesCuda, ZygoteServerNotAnswering, ZygoteServers

# What every zygote and its ranks import, imported once by the zygote server
# they are forked from (dcpcheck/ranks/zygote_server.py), beside the
# implementation: torch, and pytest, which the test module of every rank
# function imports. Nothing that could initialise CUDA before a fork.
ZYGOTE_PRELOAD = ["torch.distributed", "pytest"]
OUT_OF_MEMORY_FIRST_WAIT_S = 1.0  # before the second try of a start that ran out of device memory
# Below this share of a GPU free (or the case's need, where more), a case ends
# its process's idle pools first: each rank holds a CUDA context, a process
# keeps a pool per world size, and several sessions' workers share the GPU.
LOW_FREE_GPU_SHARE = 0.25


class SpawnedRanks:
    def __init__(
        self,
        placement: Callable[[int], Placement],
        *,
        impl_spec: str,
        case_timeout: float,
        startup_timeout: float,
        gpu_memory: Callable[[int], GpuMemory | None] = gpu_memory,
        gpu_ledger: Callable[[int], GpuLedger | None] = host_ledger,
    ):
        self.placement = placement  # world size -> where its ranks run
        self.gpu_memory = gpu_memory  # CUDA index -> its total and free memory now (None: unknown)
        self.gpu_ledger = gpu_ledger  # CUDA index -> the host's ledger of declared needs on it (None: unknown)
        self.impl_spec = impl_spec
        self.startup_timeout = startup_timeout
        self.collective_timeout = case_timeout + COLLECTIVE_TIMEOUT_GRACE_S
        self.pools: dict[int, RankPool] = {}
        # A server answers within --dcp-timeout, beyond what it was asked to wait.
        self.zygotes = ZygoteServers(ZYGOTE_PRELOAD, startup_timeout, answer_timeout=case_timeout)
        # world size -> why its pool could not start: not tried again in this
        # session (the same failure, the same wait, on every later test).
        self.start_failures: dict[int, str] = {}
        # Zygote servers load the implementation before forking, until one
        # finds that this initialises CUDA (ImplInitialisesCuda).
        self.preload_impl = True

    def _live_pool(self, world_size: int) -> tuple[RankPool, bool]:
        """-> (the pool for ``world_size``, whether it was started now: it had
        none or its ranks died)."""
        pool = self.pools.get(world_size)
        try:
            if pool is not None and pool.alive:
                return pool, False
        except ZygoteServerNotAnswering:
            self._discard(world_size)  # its server was killed: what it leaves of the pool goes too
            raise
        if pool is not None:
            pool.kill()  # whatever is left of it: the zygote, surviving ranks, the temporary directory
        if world_size in self.start_failures:
            raise LaunchError(
                f"not tried again: the pool of {world_size} ranks failed to start earlier in this session: "
                + self.start_failures[world_size]
            )
        try:
            return self._start_pool(world_size), True
        except LaunchError as exc:
            self.start_failures[world_size] = str(exc)
            raise

    def _start_pool(self, world_size: int) -> RankPool:
        """A started pool of ``world_size`` ranks. A start that ran out of
        device memory ends this process's other pools (idle: one case runs at
        a time), then is tried again after waits that double, within
        --dcp-startup-timeout: memory that other sessions' ranks hold comes free
        as their cases end."""
        gated = self._wait_out_large_holds(world_size)
        deadline = time.monotonic() + self.startup_timeout
        waits = (OUT_OF_MEMORY_FIRST_WAIT_S * 2**attempt for attempt in itertools.count())
        ended, tries = [], 0
        while True:
            pool = RankPool(
                self.placement(world_size),
                impl_spec=self.impl_spec,
                startup_timeout=self.startup_timeout,
                collective_timeout=self.collective_timeout,
                zygotes=self.zygotes,
                preload_impl=self.preload_impl,
            )
            self.pools[world_size] = pool
            try:
                pool.start()
            except ImplInitialisesCuda:
                self._discard(world_size)
                self.preload_impl = False
                continue
            except PoolOutOfMemory as exc:
                self._discard(world_size)
                tries += 1
                if self.pools:
                    ended += self._end_idle_pools(keep=None)
                    continue
                wait = next(waits)
                if time.monotonic() + wait > deadline:
                    freed = f", after ending this process's pools of W {ended}" if ended else ""
                    raise PoolOutOfMemory(
                        f"out of device memory at {tries} starts within --dcp-startup-timeout "
                        f"{self.startup_timeout:g} s{freed}; the last: {exc}"
                    ) from None
                time.sleep(wait)
                continue
            except BaseException:
                self._discard(world_size)
                raise
            if tries:
                pool.startup["out_of_memory_retries"] = tries
            if gated >= 0.1:
                pool.startup["gpu_ledger_wait_s"] = round(gated, 1)
            return pool

    def _wait_out_large_holds(self, world_size: int) -> float:
        """Wait, at most --dcp-startup-timeout on each GPU the pool would use, while another process's case holds
        most of it (the GPU ledger) -> the seconds waited."""
        placement = self.placement(world_size)
        if placement.device_type != "cuda":
            return 0.0
        ledgers = (self.gpu_ledger(index) for index in range(placement.gpus_used))
        return sum(ledger.wait_out_large_holds(self.startup_timeout) for ledger in ledgers if ledger is not None)

    def decide_before_launch(self, case: Case, ask):
        return ask()  # the pytest process is the one place that asks

    def _end_idle_pools_if_gpu_short(self, case: Case) -> int:
        """End this process's pools of other world sizes (idle: one case runs
        at a time) where a GPU the case runs on has less free than
        LOW_FREE_GPU_SHARE of it or than the case's ``gpu_gib_needed``, or a case
        waits for memory there (the GPU ledger): -> how many were ended."""
        placement = self.placement(case.world_size)
        if placement.device_type != "cuda" or not set(self.pools) - {case.world_size}:
            return 0
        for index in range(placement.gpus_used):
            ledger = self.gpu_ledger(index)
            memory = self.gpu_memory(index)
            short = False
            if memory is not None:
                floor = max(LOW_FREE_GPU_SHARE * memory.total_bytes, case.gpu_gib_needed * 2**30)
                short = memory.free_bytes < floor
            if short or (ledger is not None and ledger.someone_waits()):
                return len(self._end_idle_pools(keep=case.world_size))
        return 0

    def _hold_gpu_memory(self, case: Case, stack: ExitStack) -> float:
        """Hold the case's declared GPU memory in each of its GPUs' ledgers for the case (in index order, so
        that two multi-GPU cases never wait for each other), waiting at most the case's timeout on each:
        -> the seconds waited."""
        placement = self.placement(case.world_size)
        if placement.device_type != "cuda" or not case.gpu_gib_needed:
            return 0.0
        # A live pool of the case's size already holds its ranks' contexts, which the need counts.
        pool = self.pools.get(case.world_size)
        try:
            alive = pool is not None and pool.alive
        except ZygoteServerNotAnswering:
            alive = False  # _live_pool meets it again, and says so
        held_already = CUDA_CONTEXT_GIB * placement.ranks_per_gpu if alive else 0.0
        waited = 0.0
        for index in range(placement.gpus_used):
            ledger = self.gpu_ledger(index)
            if ledger is not None:
                hold = ledger.hold(case.gpu_gib_needed, case.nodeid, case.timeout, case.gpu_gib_needed - held_already)
                waited += stack.enter_context(hold)
        return waited

    def _end_idle_pools(self, keep: int | None) -> list[int]:
        """End every pool but ``keep``'s (idle: one case runs at a time): -> their world sizes."""
        ended = sorted(size for size in self.pools if size != keep)
        for size in ended:
            self._discard(size)
        return ended

    def run(self, fn, case: Case) -> CaseResult:
        ended = self._end_idle_pools_if_gpu_short(case)  # first: the ledger may wait for this process's memory too
        with ExitStack() as held:
            waited = self._hold_gpu_memory(case, held)
            result = self._run(fn, case, ended)
        if waited >= 0.1:  # beside a pool start's own wait (_wait_out_large_holds)
            result.pool_startup["gpu_ledger_wait_s"] = round(
                result.pool_startup.get("gpu_ledger_wait_s", 0) + waited, 1
            )
        return result

    def _run(self, fn, case: Case, ended: int) -> CaseResult:
        world_size = case.world_size
        for attempt in (1, 2):
            pool, started = self._live_pool(world_size)
            try:
                result = pool.run(fn, case)
                if started:
                    result.pool_startup = dict(pool.startup)
                if ended:
                    result.pool_startup["idle_pools_ended"] = ended
            except RankGoneBeforeCase as gone:
                # It died between cases: the case never ran there. Once more on a fresh pool.
                self._discard(world_size)
                if attempt == 2:
                    raise LaunchError(
                        f"rank {gone.rank} of a fresh pool of {world_size} ranks ended before it started the "
                        f"case, as one of the pool before it had: {gone.how}"
                    ) from None
                continue
            except BaseException:
                # Ctrl-C (or any error) mid-case: the ranks are still in it, so an
                # orderly stop would wait for them. Kill the pool now.
                self._discard(world_size)
                raise
            if result.stuck or result.dead:
                self._discard(world_size)
            return result

    def _discard(self, world_size: int) -> None:
        self.pools.pop(world_size).kill()

    def stop(self) -> None:
        for pool in self.pools.values():
            pool.stop()
        self.pools.clear()
        self.zygotes.stop()  # after the pools: a server's death ends every pool it forked
