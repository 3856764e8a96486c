"""Spawned ranks for plain ``pytest``: one persistent pool per world size."""

from __future__ import annotations

from dcpcheck.ranks.pool import CaseResult, RankPool


class SpawnedRanks:
    def __init__(self, device_type: str, *, startup_timeout: float, collective_timeout: float):
        self.device_type = device_type
        self.startup_timeout = startup_timeout
        self.collective_timeout = collective_timeout
        self.pools: dict[int, RankPool] = {}

    def pool(self, world_size: int, impl_spec: str) -> RankPool:
        """The live pool for ``world_size``, (re)started when needed."""
        pool = self.pools.get(world_size)
        if pool is None or not pool.alive:
            pool = RankPool(
                world_size,
                self.device_type,
                impl_spec=impl_spec,
                startup_timeout=self.startup_timeout,
                collective_timeout=self.collective_timeout,
            )
            self.pools[world_size] = pool
            pool.start()
        return pool

    def run(self, world_size: int, fn, case: dict, *, seed: int, impl_spec: str, timeout: float) -> CaseResult:
        return self.pool(world_size, impl_spec).run(fn, case, seed=seed, impl_spec=impl_spec, timeout=timeout)

    def stop(self) -> None:
        for pool in self.pools.values():
            pool.stop()
        self.pools.clear()
