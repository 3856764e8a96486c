"""``tools/gpu_ci_load.py``: a wave's load, as the GPU CI's summary gives it. The busy share of the cores
comes from /proc/stat (a busy loop beside the sampler must show), the GPU's used memory and busy share from NVML
(here stand-in answers), one CSV row a sample."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from tests.selftest.support.inner import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))

import gpu_ci_load  # tools/ is on sys.path
import gpu_ci_process_cpu
from gpu_ci_process_cpu import KINDS, process_kind

from dcpcheck.ranks.gpu_free import GpuMemory


def test_describe_names_the_mean_the_saturated_share_and_the_peak():
    load = gpu_ci_load.WaveLoad(cpu_busy=[0.5, 1.0, 0.95, 0.15], gpu_used_gib=[[10.0], [74.25], [float("nan")]])
    assert load.describe() == "CPU busy mean 65%, 50% of seconds at >= 90%; GPU used peak 74.2 GiB"
    assert gpu_ci_load.WaveLoad().describe() == "no load samples"


def test_describe_gives_each_gpus_mean_busy_share_over_the_samples_nvml_answered():
    nan = float("nan")
    load = gpu_ci_load.WaveLoad(gpu_used_gib=[[1.0, 2.0]] * 3, gpu_busy=[[0.5, 0.1], [nan, 0.2], [0.75, nan]])
    assert load.describe() == "GPU used peak 1.0, 2.0 GiB; GPU busy mean 62%, 15%"
    unanswered = gpu_ci_load.WaveLoad(gpu_used_gib=[[1.0]], gpu_busy=[[nan], [nan]])
    assert unanswered.describe() == "GPU used peak 1.0 GiB"


@pytest.mark.skipif(gpu_ci_load.cpu_times() is None, reason="no /proc/stat: not Linux")
def test_the_sampler_sees_a_busy_core_and_writes_a_row_a_sample(tmp_path, monkeypatch):
    used = iter(range(1, 100))
    monkeypatch.setattr(gpu_ci_load, "gpu_memory", lambda index: GpuMemory(80 * 2**30, (80 - next(used)) * 2**30))
    monkeypatch.setattr(gpu_ci_load, "gpu_busy", lambda index: None)
    csv = tmp_path / "load.csv"
    # A child spins, not this thread: a spinning thread here would hold the GIL the sampler needs for each file
    # it reads under /proc, and the sampler would take a sample a second or less.
    spin = "import time\nend = time.perf_counter() + 1.0\nwhile time.perf_counter() < end: pass"
    with gpu_ci_load.LoadSampler(1, csv, wave=0, period=0.2) as load:
        subprocess.run([sys.executable, "-c", spin], check=True)
    rows = csv.read_text().splitlines()
    assert rows[0] == "wave,t_s,cpu_busy,gpu0_used_gib,gpu0_busy," + ",".join(f"cpu_s_{kind}" for kind in KINDS)
    assert len(rows) - 1 == len(load.cpu_busy) == len(load.gpu_used_gib) >= 3
    # One core of os.cpu_count() spun the whole time; the rest of this host may idle.
    cores = os.cpu_count() or 1
    assert sum(load.cpu_busy) / len(load.cpu_busy) >= 0.5 / cores
    assert [sample[0] for sample in load.gpu_used_gib] == [float(n) for n in range(1, len(rows))]


def test_the_csv_has_each_gpus_busy_share_after_the_memory_columns(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_ci_load, "gpu_memory", lambda index: GpuMemory(80 * 2**30, (80 - 8 * (index + 1)) * 2**30))
    monkeypatch.setattr(gpu_ci_load, "gpu_busy", lambda index: 0.63 if index == 0 else None)
    csv = tmp_path / "load.csv"
    with gpu_ci_load.LoadSampler(2, csv, wave=3, period=0.05) as load:
        while len(load.gpu_busy) < 2:
            time.sleep(0.01)
    rows = [row.split(",") for row in csv.read_text().splitlines()]
    gpus = ["gpu0_used_gib", "gpu1_used_gib", "gpu0_busy", "gpu1_busy"]
    assert rows[0] == ["wave", "t_s", "cpu_busy", *gpus, *(f"cpu_s_{kind}" for kind in KINDS)]
    assert len(rows) - 1 == len(load.gpu_busy) >= 2
    assert all(row[0] == "3" and row[3:7] == ["8.00", "16.00", "0.63", ""] for row in rows[1:])
    assert all(sample[0] == 0.63 and sample[1] != sample[1] for sample in load.gpu_busy)  # NaN: no answer


@pytest.mark.parametrize(
    "cmdline, kind",
    [
        (["/usr/bin/python3", "-m", "dcpcheck.ranks.zygote_server", "--fd", "5"], "ranks"),
        (["python3", "-m", "torch.distributed.run", "--standalone", "-m", "pytest"], "torchrun"),
        (["/opt/venv/bin/python", "-m", "pytest", "tests/stage1_index"], "pytest"),
        (["python", "-c", "import sys;exec(eval(sys.stdin.readline()))"], "pytest"),  # an xdist worker
        (["/usr/local/cuda/bin/ptxas", "-arch=sm_90"], "compilers"),
        (["nvidia-smi"], "other"),
        ([], "other"),  # a process whose command line could not be read
    ],
)
def test_a_process_is_told_by_its_command_line(cmdline, kind):
    assert process_kind(cmdline) == kind


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="no /proc: not Linux")
def test_the_cpu_seconds_of_a_busy_process_go_to_its_kind(tmp_path, monkeypatch):
    # This host may run other rank processes (xdist workers beside this one): only the child below is "ranks".
    marker = f"spinner-{os.getpid()}-{time.monotonic_ns()}"
    monkeypatch.setattr(gpu_ci_process_cpu, "process_kind", lambda cmdline: "ranks" if marker in cmdline else "other")
    monkeypatch.setattr(gpu_ci_load, "gpu_memory", lambda index: None)
    # It works 0.6 CPU seconds, on a quiet machine before the first sample sees it (a process started within the
    # wave counts from its start), then sleeps past a sample. CPU seconds, not wall seconds: on a loaded machine
    # the same wall time gets a fraction of a core.
    spin = "import time\nwhile time.process_time() < 0.6: pass\ntime.sleep(1.5)"
    with gpu_ci_load.LoadSampler(0, tmp_path / "load.csv", wave=0, period=1.0) as load:
        subprocess.run([sys.executable, "-c", spin, marker], check=True)
    assert 0.5 <= load.cpu_seconds["ranks"] <= 1.2, load.cpu_seconds  # its 0.6 s of work and its start
    assert re.search(r"CPU seconds by process: (\w+ \d+, )*ranks [12]\b", load.describe()), load.describe()
