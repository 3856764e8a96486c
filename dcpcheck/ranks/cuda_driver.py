"""What dcpcheck asks CUDA's driver (``libcuda.so.1``, one copy per host)
directly, without torch: how a rank waits for its GPU, and whether a process
initialised the driver (after which its forks cannot use the GPU).

How a rank waits: asleep in the driver, not spinning. CUDA's default schedule
(``CU_CTX_SCHED_AUTO``) spins a core in every synchronisation while a process
has fewer contexts than the host has cores, which is every rank here. Up to
40 ranks of several xdist workers share one GPU and wait on it most of the
time: spinning, they held the host's cores busy and starved the ranks with
host work to do. Blocking sync trades that for a wake-up latency per
synchronisation. It is set on the device's primary context, the one torch's
runtime uses, before the rank creates it (:func:`dcpcheck.ranks.worker._init_cuda`,
:class:`dcpcheck.ranks.torchrun.InProcessRanks`); ``cuDevicePrimaryCtxSetFlags_v2``
(CUDA 11+) also applies to an active context.
"""

from __future__ import annotations

import ctypes

# cuda.h, CUctx_flags
SCHED_MASK = 0x07
SCHED_NAMES = {0x00: "auto", 0x01: "spin", 0x02: "yield", 0x04: "blocking sync"}
SCHED_BLOCKING_SYNC = 0x04
CUDA_ERROR_NOT_INITIALIZED = 3  # cuda.h, CUresult


class CudaDriverError(RuntimeError):
    """A driver call failed: names the call and CUDA's error."""


def _driver():
    return ctypes.CDLL("libcuda.so.1")


def _call(driver, name: str, *args) -> None:
    code = getattr(driver, name)(*args)
    if code != 0:
        text = ctypes.c_char_p()
        driver.cuGetErrorName(code, ctypes.byref(text))
        error = text.value.decode() if text.value else f"CUresult {code}"
        raise CudaDriverError(f"CUDA driver call {name} failed with {error}")


def _device(driver, index: int) -> ctypes.c_int:
    _call(driver, "cuInit", 0)
    device = ctypes.c_int()
    _call(driver, "cuDeviceGet", ctypes.byref(device), index)
    return device


def block_while_waiting(index: int) -> None:
    """Make GPU ``index``'s primary context (this process's) block in every synchronisation."""
    driver = _driver()
    _call(driver, "cuDevicePrimaryCtxSetFlags_v2", _device(driver, index), SCHED_BLOCKING_SYNC)


def driver_initialised() -> bool:
    """Whether this process initialised CUDA's driver (``cuInit``; torch's first
    CUDA call does): a process forked after that cannot use the GPU. Initialises nothing."""
    count = ctypes.c_int()
    return _driver().cuDeviceGetCount(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED


def schedule(index: int) -> str:
    """The schedule of GPU ``index``'s primary context in this process: ``"blocking sync"``, ``"spin"``, ..."""
    driver = _driver()
    flags, active = ctypes.c_uint(), ctypes.c_int()
    _call(driver, "cuDevicePrimaryCtxGetState", _device(driver, index), ctypes.byref(flags), ctypes.byref(active))
    return SCHED_NAMES.get(flags.value & SCHED_MASK, f"flags {flags.value:#x}")
