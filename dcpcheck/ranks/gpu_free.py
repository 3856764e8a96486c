"""How much memory the GPUs hold free right now, and how busy they are, asked of
NVML (``libnvidia-ml.so.1``) directly: no CUDA context in the pytest process, and
it sees what every process on the host holds (other xdist workers' ranks,
other sessions'), which torch's allocator statistics cannot.

A CUDA device index is the one the ranks see, so it is mapped through
``CUDA_VISIBLE_DEVICES`` to NVML's; an entry NVML cannot be asked about (a
MIG instance, a UUID prefix) gives no answer rather than another GPU's.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import cache

NVML_SUCCESS = 0


class _NvmlMemory(ctypes.Structure):  # nvml.h, nvmlMemory_t
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class _NvmlUtilization(ctypes.Structure):  # nvml.h, nvmlUtilization_t
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


@dataclass(frozen=True)
class GpuMemory:
    total_bytes: int
    free_bytes: int


@cache
def _nvml():
    """NVML, initialised once per process (asked before every case on CUDA); None where it cannot be loaded or started."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    return nvml if nvml.nvmlInit_v2() == NVML_SUCCESS else None


def _handle(nvml, cuda_index: int):
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    handle = ctypes.c_void_p()
    if visible is None:
        code = nvml.nvmlDeviceGetHandleByIndex_v2(cuda_index, ctypes.byref(handle))
    else:
        entries = [entry.strip() for entry in visible.split(",")]
        if cuda_index >= len(entries):
            return None
        entry = entries[cuda_index]
        if entry.isdigit():
            code = nvml.nvmlDeviceGetHandleByIndex_v2(int(entry), ctypes.byref(handle))
        elif entry.startswith("GPU-"):
            code = nvml.nvmlDeviceGetHandleByUUID(entry.encode(), ctypes.byref(handle))
        else:
            return None
    return handle if code == NVML_SUCCESS else None


def _ask(cuda_index: int, query: str, *answer) -> bool:
    """Whether NVML's ``query`` of CUDA device ``cuda_index`` answered into ``answer`` (its arguments after the
    device's handle)."""
    nvml = _nvml()
    handle = None if nvml is None else _handle(nvml, cuda_index)
    return handle is not None and getattr(nvml, query)(handle, *answer) == NVML_SUCCESS


def gpu_memory(cuda_index: int) -> GpuMemory | None:
    """Total and free memory of CUDA device ``cuda_index``; None where NVML cannot say."""
    memory = _NvmlMemory()
    if not _ask(cuda_index, "nvmlDeviceGetMemoryInfo", ctypes.byref(memory)):
        return None
    return GpuMemory(total_bytes=memory.total, free_bytes=memory.free)


def gpu_busy(cuda_index: int) -> float | None:
    """The share (0..1) of NVML's last sample period during which a kernel ran on CUDA device ``cuda_index``;
    None where NVML cannot say."""
    utilization = _NvmlUtilization()
    if not _ask(cuda_index, "nvmlDeviceGetUtilizationRates", ctypes.byref(utilization)):
        return None
    return utilization.gpu / 100


def gpu_uuid(cuda_index: int) -> str | None:
    """NVML's UUID of CUDA device ``cuda_index`` (``GPU-...``): one name for it in every process of the host,
    whatever each one's ``CUDA_VISIBLE_DEVICES``; None where NVML cannot say."""
    name = ctypes.create_string_buffer(96)  # nvml.h: NVML_DEVICE_UUID_V2_BUFFER_SIZE
    if not _ask(cuda_index, "nvmlDeviceGetUUID", name, ctypes.c_uint(len(name))):
        return None
    return name.value.decode()
