"""Every rank waits for its GPU asleep in the driver, not spinning a core
(``dcpcheck/ranks/cuda_driver.py`` says why): in the spawned pool and under torchrun."""

from __future__ import annotations

import pytest

from dcpcheck.ranks.cuda_driver import schedule

pytestmark = pytest.mark.gpu


def rank_schedule(ctx) -> str:
    return schedule(ctx.device.index)


def test_every_rank_waits_for_its_gpu_in_blocking_sync(dcp):
    assert dcp.run(rank_schedule) == ["blocking sync"] * dcp.world_size
