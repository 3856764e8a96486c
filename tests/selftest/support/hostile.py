"""Rank functions that attack the harness itself, the way a half-finished or
hostile implementation would: they hang, leave a case early, hold the GIL,
stop themselves, start processes, change global state, raise monsters."""

from __future__ import annotations

import ctypes
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import warnings
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from dcpcheck.ranks.procstate import parent_pid
from tests.selftest.support.rank_functions import sum_of_ranks


def sleep_on_rank(ctx, *, bad_rank: int) -> None:
    """``bad_rank`` hangs in Python, outside any collective; its peers wait in one."""
    if ctx.rank == bad_rank:
        time.sleep(3600)
    sum_of_ranks(ctx)


def leave_on_rank(ctx, *, bad_rank: int, how: str, before_collective: bool = True) -> None:
    """``bad_rank`` leaves the case early: ``SystemExit``, ``KeyboardInterrupt`` or ``os._exit``."""
    if not before_collective:
        sum_of_ranks(ctx)
    if ctx.rank == bad_rank:
        if how == "SystemExit":
            raise SystemExit(0)
        if how == "KeyboardInterrupt":
            raise KeyboardInterrupt
        os._exit(7)
    if before_collective:
        sum_of_ranks(ctx)


def block_holding_the_gil(ctx, *, marker: str, stop_rank: int | None = None) -> None:
    """Blocks in C with the GIL held and every signal held back (``sigsuspend``
    on a full mask, called through ``ctypes.PyDLL``, which keeps the GIL), so
    no Python thread of this process (an orphan guard, a signal handler) runs
    again, and no core is spent: a bound on how fast the harness ends such a
    case is not loaded by the case itself. ``stop_rank`` stops itself (SIGSTOP)
    first."""
    Path(f"{marker}.{ctx.rank}").write_text(str(os.getpid()))
    if ctx.rank == stop_rank:
        os.kill(os.getpid(), signal.SIGSTOP)
    every_signal = (ctypes.c_ubyte * 128)(*[0xFF] * 128)  # a sigset_t with every bit set
    ctypes.PyDLL(None).sigsuspend(ctypes.byref(every_signal))


def report_then_exit(ctx, *, bad_rank: int) -> int:
    """``bad_rank`` returns at once and its process exits 1 s later, after it reported (what a rank does after
    its function returned took 0.2 s and more on a busy GPU host, so it died before it reported); the others
    are still in the case when it is gone."""
    if ctx.rank == bad_rank:
        threading.Timer(1.0, os._exit, args=(0,)).start()
    else:
        time.sleep(3.0)
    return ctx.rank


def _exit_after_the_next(method: str) -> None:
    """This process exits right after its next ``Connection.<method>`` call:
    the rank's next message to the pytest process, or the next task it receives."""
    original = getattr(Connection, method)

    def call_then_exit(self, *args):
        original(self, *args)
        os._exit(0)

    setattr(Connection, method, call_then_exit)


def exit_after_reporting(ctx, *, bad_rank: int) -> int:
    """``bad_rank``'s process exits as soon as it has sent this case's outcome,
    while it waits for its next task."""
    if ctx.rank == bad_rank:
        _exit_after_the_next("send")
    return ctx.rank


def exit_on_the_next_task(ctx, *, bad_rank: int) -> int:
    """``bad_rank``'s process exits when its next task reaches it, before it starts it."""
    if ctx.rank == bad_rank:
        _exit_after_the_next("recv")
    return ctx.rank


def stop_myself(ctx, *, bad_rank: int) -> None:
    if ctx.rank == bad_rank:
        os.kill(os.getpid(), signal.SIGSTOP)
    sum_of_ranks(ctx)


def start_processes(ctx, *, pid_file: str, then_hang: bool = False) -> None:
    """Start a child, a child in a new session and a daemon (double fork); write their pids."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    child = subprocess.Popen(sleeper)
    session_child = subprocess.Popen(sleeper, start_new_session=True)
    daemonizer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; print(subprocess.Popen(sys.argv[1:], start_new_session=True, stdout=subprocess.DEVNULL).pid)",
            *sleeper,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    daemon_pid = int(daemonizer.communicate()[0])
    Path(f"{pid_file}.{ctx.rank}").write_text(f"{child.pid} {session_child.pid} {daemon_pid}")
    if then_hang:
        time.sleep(3600)


# The exit system call ends one thread, where exit_group (os._exit) ends them all.
SYS_EXIT = {"x86_64": 60, "aarch64": 93}


def end_main_thread_after_starting_processes(ctx, *, marker: str, pid_file: str) -> None:
    """Start processes (see :func:`start_processes`), then end this rank's
    main thread alone: the process lives on in its other threads while
    ``/proc`` shows it as a zombie, as a rank killed by a signal is shown for
    a moment when its main thread ends before the others, with its children
    still below it."""
    start_processes(ctx, pid_file=pid_file)
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    Path(f"{marker}.{ctx.rank}").write_text(str(os.getpid()))
    ctypes.CDLL(None).syscall(SYS_EXIT[platform.machine()], 0)


LEAKED_VARIABLE = "DCPCHECK_SELFTEST_LEAK"


def change_global_state(ctx) -> None:
    """What a careless implementation does: a process-wide default dtype and
    grad mode, an environment variable, and a draw from the global RNG."""
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    os.environ[LEAKED_VARIABLE] = "1"
    torch.rand(1)


def set_variable_then_sleep_on_rank(ctx, *, bad_rank: int) -> None:
    """Every rank sets :data:`LEAKED_VARIABLE`, then the case gets stuck (see :func:`sleep_on_rank`)."""
    os.environ[LEAKED_VARIABLE] = "set by a stuck case"
    sleep_on_rank(ctx, bad_rank=bad_rank)


def variable_seen(ctx) -> str | None:
    """:data:`LEAKED_VARIABLE` as the next case finds it, after a collective."""
    sum_of_ranks(ctx)
    return os.environ.get(LEAKED_VARIABLE)


def change_state_between_cases(ctx) -> None:
    """Nothing changes while the case runs; once it has ended, as the next
    case's task reaches the rank (code the case left to run at idle), every
    rank makes warnings errors, makes ``meta`` the default device and
    reassigns its group's world size."""
    group, original = ctx.group, Connection.recv

    def recv_then_change_state(self):
        task = original(self)
        Connection.recv = original
        warnings.simplefilter("error")
        torch.set_default_device("meta")
        group.world_size = 1
        return task

    Connection.recv = recv_then_change_state


def global_state_seen(ctx) -> tuple:
    """What the next case finds: it must be the known state."""
    return torch.get_default_dtype(), torch.is_grad_enabled(), os.environ.get(LEAKED_VARIABLE), torch.rand(1).item()


class MonstrousError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str() of this exception raises")


def raise_monsters(ctx, *, kind: str) -> None:
    """An exception of 20 MB, one whose ``str()`` raises, or ``SystemExit(0)``; after the collectives."""
    sum_of_ranks(ctx)
    if ctx.rank == ctx.world_size - 1:
        if kind == "huge":
            raise ValueError("x" * 20_000_000)
        if kind == "str raises":
            raise MonstrousError()
        raise SystemExit(0)


def kill_the_zygote_server(ctx) -> None:
    """Rank 0 kills the process its pool's zygote was forked from, then every rank waits in a collective."""
    if ctx.rank == 0:
        os.kill(parent_pid(os.getppid()), signal.SIGKILL)
    sum_of_ranks(ctx)
    time.sleep(3600)


def stop_the_zygote_server(ctx, *, marker: str) -> None:
    """Rank 0 stops (SIGSTOP) the process its pool's zygote was forked from,
    as a debugger or an overloaded host does, and writes its pid to ``marker``;
    the case itself needs nothing of it."""
    if ctx.rank == 0:
        server = parent_pid(os.getppid())
        Path(marker).write_text(str(server))
        os.kill(server, signal.SIGSTOP)


def change_the_group(ctx) -> None:
    """What a careless implementation does to the group object it was handed:
    reassigns its world size and rank, deletes its CPU group."""
    ctx.group.world_size = 1
    ctx.group.rank_in_group = 5 + ctx.rank
    del ctx.group.cpu_group


def group_seen(ctx) -> tuple:
    """What the next case finds of its group: its rank and world size, after a barrier through its CPU group."""
    ctx.group.barrier()
    return ctx.group.rank_in_group, ctx.group.world_size
