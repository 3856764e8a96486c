"""What the host was busy with while a wave of the GPU CI ran (``tools/gpu_ci.py``): the share of its cores
that were busy (``/proc/stat``), the memory used on each GPU (NVML, as every process on the host holds it) and
the share of time each GPU ran a kernel (NVML: time-slicing among the ranks), sampled once a second, and the
CPU seconds each kind of process used (``gpu_ci_process_cpu.py``). The summary gives each wave's mean and peak,
so that a wave bound by the cores is told from one bound by GPU memory (idle pools ended, ledger waits) before
its sessions are moved or given workers; each sample goes to ``<out>/load.csv``."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from gpu_ci_process_cpu import KINDS, ProcessCpu

from dcpcheck.ranks.gpu_free import gpu_busy, gpu_memory

PERIOD_S = 1.0
BUSY_SHARE = 0.9  # a sample at or above this share of busy cores counts as a saturated second


def cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores since boot, from /proc/stat's ``cpu`` line; None off Linux."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


@dataclass
class WaveLoad:
    """One wave's samples: the busy share of the cores over each period, the GiB used on each GPU, the share of
    time each GPU ran a kernel."""

    cpu_busy: list[float] = field(default_factory=list)
    gpu_used_gib: list[list[float]] = field(default_factory=list)  # per sample, per GPU
    gpu_busy: list[list[float]] = field(default_factory=list)  # per sample, per GPU (NaN: NVML had no answer)
    cpu_seconds: Counter = field(default_factory=Counter)  # kind of process (gpu_ci_process_cpu.KINDS) -> seconds

    def describe(self) -> str:
        """``CPU busy mean 71 %, 38 % of seconds at >= 90 %; GPU used peak 74.1 GiB; GPU busy mean 63 %``
        (what was measured)."""
        parts = []
        if self.cpu_busy:
            mean = sum(self.cpu_busy) / len(self.cpu_busy)
            saturated = sum(busy >= BUSY_SHARE for busy in self.cpu_busy) / len(self.cpu_busy)
            parts.append(f"CPU busy mean {mean:.0%}, {saturated:.0%} of seconds at >= {BUSY_SHARE:.0%}")
        peaks = [max(used) for used in _answered(self.gpu_used_gib)]
        if peaks:
            parts.append("GPU used peak " + ", ".join(f"{peak:.1f}" for peak in peaks) + " GiB")
        means = [sum(busy) / len(busy) for busy in _answered(self.gpu_busy)]
        if means:
            parts.append("GPU busy mean " + ", ".join(f"{mean:.0%}" for mean in means))
        if any(self.cpu_seconds.values()):
            spent = [f"{kind} {seconds:.0f}" for kind, seconds in self.cpu_seconds.most_common() if seconds >= 0.5]
            parts.append(f"CPU seconds by process: {', '.join(spent) or 'under 1 s'}")
        return "; ".join(parts) or "no load samples"


def _answered(samples: list[list[float]]) -> list[list[float]]:
    """Per GPU, its values over ``samples`` (each: one value a GPU) that NVML answered (not NaN); a GPU without
    any is left out."""
    gpus = len(samples[0]) if samples else 0
    per_gpu = [[sample[gpu] for sample in samples if sample[gpu] == sample[gpu]] for gpu in range(gpus)]
    return [values for values in per_gpu if values]


class LoadSampler:
    """Samples while it is open (a thread): ``with LoadSampler(gpus, csv, wave) as load: ...`` -> a WaveLoad."""

    def __init__(self, gpus: int, csv: Path, wave: int, period: float = PERIOD_S):
        self.gpus, self.csv, self.wave, self.period = gpus, csv, wave, period
        self.load = WaveLoad()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> WaveLoad:
        if not self.csv.exists():
            header = ["wave", "t_s", "cpu_busy"] + [f"gpu{index}_used_gib" for index in range(self.gpus)]
            header += [f"gpu{index}_busy" for index in range(self.gpus)] + [f"cpu_s_{kind}" for kind in KINDS]
            self.csv.write_text(",".join(header) + "\n")
        self._processes = ProcessCpu()  # the processes' seconds so far: before the wave starts any
        self._thread.start()
        return self.load

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        started, last, processes = time.perf_counter(), cpu_times(), self._processes
        with open(self.csv, "a") as csv:
            while not self._stop.wait(self.period):
                now = cpu_times()
                busy = None
                if now and last and now[1] > last[1]:
                    busy = (now[0] - last[0]) / (now[1] - last[1])
                    self.load.cpu_busy.append(busy)
                last = now
                used, kernels = [], []
                for index in range(self.gpus):
                    memory = gpu_memory(index)
                    used.append((memory.total_bytes - memory.free_bytes) / 2**30 if memory else float("nan"))
                    kernels.append(gpu_busy(index))
                if self.gpus:
                    self.load.gpu_used_gib.append(used)
                    self.load.gpu_busy.append([float("nan") if share is None else share for share in kernels])
                cells = [str(self.wave), f"{time.perf_counter() - started:.1f}", "" if busy is None else f"{busy:.3f}"]
                cells += [f"{gib:.2f}" for gib in used] + ["" if share is None else f"{share:.2f}" for share in kernels]
                spent = processes.sample()
                self.load.cpu_seconds.update(spent)
                cells += [f"{spent[kind]:.2f}" for kind in KINDS]
                csv.write(",".join(cells) + "\n")
                csv.flush()
