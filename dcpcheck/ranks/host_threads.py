"""The host-side threads of processes that share a GPU host's cores.

On a GPU host the ranks do host-side torch work between their kernels (scenarios, the float64 oracle, the
comparisons), and many processes share the cores: every rank of every xdist worker, and ``tools/gpu_ci.py``'s
sessions side by side. Two rules keep that work from burning the cores it needs:

- a fair share of threads: a rank gets the cores over the ranks of its session (``OMP_NUM_THREADS``), not all
  of them each;
- idle threads sleep: OpenMP's default wait policy has each thread of a parallel region spin after it (GNU
  libgomp, which torch's Linux wheels bundle: ``GOMP_SPINCOUNT``, 300,000 turns, before it sleeps), so a
  process that runs one op, then waits for its GPU or for Python, keeps every thread of its team on a core;
  over dozens of processes that is most of the host (pytorch/pytorch#80777: 3000 % CPU for a copy in a loop).
  ``OMP_WAIT_POLICY=PASSIVE`` sleeps them at once; ``tools/omp_wait_bench.py`` measures the difference.

libgomp reads both when it loads, with torch: they must be in a process's environment when it starts (a zygote
server's, whose forks inherit it; a session's, whose processes do). A value the user set is kept.
"""

from __future__ import annotations

import os

WAIT_POLICY_VARIABLE, IDLE_THREADS_SLEEP = "OMP_WAIT_POLICY", "PASSIVE"


def idle_threads_sleep(env: dict) -> dict:
    """``env`` with, unless set, the wait policy under which idle OpenMP threads sleep."""
    env.setdefault(WAIT_POLICY_VARIABLE, IDLE_THREADS_SLEEP)
    return env


def share_host_cores(env: dict, *, processes: int) -> dict:
    """``env`` with, unless set, a thread count of the cores over ``processes`` and idle threads that sleep."""
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // processes)))
    return idle_threads_sleep(env)
