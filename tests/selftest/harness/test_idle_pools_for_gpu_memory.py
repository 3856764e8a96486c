"""A case whose GPU is short of free memory first ends its process's idle
pools of other world sizes (``SpawnedRanks._end_idle_pools_if_gpu_short``):
each of their ranks holds a CUDA context, and the workers of several sessions
share one GPU. Free memory is NVML's, its CUDA index mapped through
``CUDA_VISIBLE_DEVICES`` (``dcpcheck/ranks/gpu_free.py``). Pools and NVML are
stand-ins here: the policy is the pytest process's, and needs no GPU."""

from __future__ import annotations

import ctypes
from dataclasses import replace

import pytest

from dcpcheck.ranks import gpu_free
from dcpcheck.ranks.gpu_free import GpuMemory
from dcpcheck.ranks.launcher import Case
from dcpcheck.ranks.placement import Placement
from dcpcheck.ranks.spawned import LOW_FREE_GPU_SHARE, SpawnedRanks

GIB = 2**30
TOTAL = 80 * GIB


class StandInPool:
    def __init__(self):
        self.killed = False

    def kill(self):
        self.killed = True


def _ranks(free_bytes: int | None, device: str = "cuda") -> SpawnedRanks:
    ranks = SpawnedRanks(
        lambda world_size: Placement(device, world_size, gpus=1 if device == "cuda" else 0),
        impl_spec="port",
        case_timeout=10.0,
        startup_timeout=10.0,
        gpu_memory=lambda index: None if free_bytes is None else GpuMemory(TOTAL, free_bytes),
    )
    ranks.pools = {size: StandInPool() for size in (1, 2, 8)}
    return ranks


def _case(world_size: int, gpu_gib_needed: float = 0.0) -> Case:
    case = Case(nodeid="t", stage=None, world_size=world_size, seed=0, timeout=1.0, params={}, terms=None, header={})
    return replace(case, gpu_gib_needed=gpu_gib_needed)


def test_a_gpu_short_of_free_memory_ends_the_idle_pools_of_other_world_sizes():
    ranks = _ranks(free_bytes=int(LOW_FREE_GPU_SHARE * TOTAL) - 1)
    pools = dict(ranks.pools)
    assert ranks._end_idle_pools_if_gpu_short(_case(2)) == 2
    assert list(ranks.pools) == [2] and not pools[2].killed
    assert pools[1].killed and pools[8].killed


def test_a_case_needing_more_than_is_free_ends_them_too():
    ranks = _ranks(free_bytes=TOTAL // 2)
    assert ranks._end_idle_pools_if_gpu_short(_case(8, gpu_gib_needed=TOTAL / 2 / GIB + 1)) == 2
    assert list(ranks.pools) == [8]


@pytest.mark.parametrize(
    ("free_bytes", "device"),
    [(TOTAL // 2, "cuda"), (None, "cuda"), (0, "cpu")],
    ids=["enough free", "NVML cannot say", "ranks on CPU"],
)
def test_no_pool_is_ended_otherwise(free_bytes, device):
    ranks = _ranks(free_bytes, device)
    assert ranks._end_idle_pools_if_gpu_short(_case(2, gpu_gib_needed=1.0)) == 0
    assert sorted(ranks.pools) == [1, 2, 8]


class StandInNvml:
    """NVML's handle lookups, recording what they were asked."""

    def __init__(self):
        self.asked = []

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        self.asked.append(("index", index))
        return gpu_free.NVML_SUCCESS

    def nvmlDeviceGetHandleByUUID(self, uuid, handle):
        self.asked.append(("uuid", uuid.decode()))
        return gpu_free.NVML_SUCCESS


@pytest.mark.parametrize(
    ("visible", "cuda_index", "asked"),
    [
        (None, 1, [("index", 1)]),
        ("3,5", 1, [("index", 5)]),
        ("GPU-1234,GPU-abcd", 0, [("uuid", "GPU-1234")]),
        ("3", 1, []),
        ("MIG-1234", 0, []),
    ],
    ids=["all visible", "indices", "UUIDs", "not visible", "MIG instance"],
)
def test_a_cuda_index_is_asked_of_nvml_through_cuda_visible_devices(monkeypatch, visible, cuda_index, asked):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    nvml = StandInNvml()
    handle = gpu_free._handle(nvml, cuda_index)
    assert nvml.asked == asked
    assert (handle is None) == (not asked)
    assert handle is None or isinstance(handle, ctypes.c_void_p)


def test_without_nvml_the_free_memory_is_unknown(monkeypatch):
    monkeypatch.setattr(gpu_free, "_nvml", lambda: None)
    assert gpu_free.gpu_memory(0) is None


class AnsweringNvml(StandInNvml):
    """NVML's device queries, answering (or failing with ``code``) as nvml.h documents them."""

    def __init__(self, code=gpu_free.NVML_SUCCESS):
        super().__init__()
        self.code = code

    def nvmlDeviceGetMemoryInfo(self, handle, memory):
        memory._obj.total, memory._obj.free = 80 * 2**30, 30 * 2**30
        return self.code

    def nvmlDeviceGetUtilizationRates(self, handle, utilization):
        utilization._obj.gpu = 37
        return self.code

    def nvmlDeviceGetUUID(self, handle, name, length):
        name.value = b"GPU-1234"[: length.value]
        return self.code


def test_each_device_query_reads_nvmls_answer_and_none_where_it_fails(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(gpu_free, "_nvml", AnsweringNvml)
    assert gpu_free.gpu_memory(0) == gpu_free.GpuMemory(total_bytes=80 * 2**30, free_bytes=30 * 2**30)
    assert gpu_free.gpu_busy(0) == 0.37
    assert gpu_free.gpu_uuid(0) == "GPU-1234"
    monkeypatch.setattr(gpu_free, "_nvml", lambda: AnsweringNvml(code=999))  # NVML_ERROR_UNKNOWN
    assert gpu_free.gpu_memory(0) is None and gpu_free.gpu_busy(0) is None and gpu_free.gpu_uuid(0) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-1234")  # no handle: nothing asked
    monkeypatch.setattr(gpu_free, "_nvml", AnsweringNvml)
    assert gpu_free.gpu_memory(0) is None and gpu_free.gpu_busy(0) is None and gpu_free.gpu_uuid(0) is None
