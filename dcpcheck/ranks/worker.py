"""The processes of a spawned pool.

:mod:`dcpcheck.ranks.pool` starts one *zygote* (``python -m
dcpcheck.ranks.worker``, forked from a server that imported torch and the
implementation: :mod:`dcpcheck.ranks.zygote_server`), which forks the W
ranks: each rank joins the process group once and runs the rank functions
the pytest process sends it until told to stop. The zygote reports how each
rank exited.

Nothing outlives a session (:mod:`dcpcheck.ranks.reaper`): the kernel sends
the zygote SIGTERM when pytest dies, and the zygote then kills its whole tree
(ranks, and whatever they started, detached or not: it is their subreaper)
and removes the pool's temporary directory; a rank gets SIGKILL from the
kernel when the zygote dies, even while it spins holding the GIL; and every
process a case started is killed when the case ends.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import pickle
import shutil
import signal
import socket
import sys
import time
from datetime import timedelta
from multiprocessing.connection import Connection

from dcpcheck.ranks import messages
from dcpcheck.ranks.reaper import (
    become_subreaper,
    die_with_parent,
    end_case_processes,
    kill_tree,
)

STACK_SIGNAL = signal.SIGUSR1
ORPHANED_SIGNAL = signal.SIGTERM  # the zygote's, from the kernel when pytest dies
# Also from the kernel when pytest dies while a rank is stopped: the pool's
# process group is then orphaned with a stopped member, and SIGHUP (whose
# default action ends the zygote at once) comes before SIGTERM.
ORPHANED_GROUP_SIGNAL = signal.SIGHUP


def _connect(path: str) -> Connection:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return Connection(sock.detach())


def _init_cuda(device) -> float:
    """Create this rank's CUDA context on ``device``: -> the seconds it took."""
    import torch

    from dcpcheck.ranks.cuda_driver import block_while_waiting

    started = time.perf_counter()
    block_while_waiting(device.index)
    torch.cuda.set_device(device)
    torch.zeros(1, device=device)  # the context and the allocator exist from here on
    return time.perf_counter() - started


# What a start-up error says where the device had no memory left: CUDA's own
# text for cudaErrorMemoryAllocation (a context that could not be created) and
# torch's allocator's; NCCL's, where its buffers' cudaMallocAsync failed at
# communicator init ("unhandled cuda error ... Failed to CUDA calloc async 608
# bytes", NCCL 2.28 on a full H100).
OUT_OF_MEMORY_TEXTS = ("out of memory", "failed to cuda calloc", "failed to cuda malloc")


def _out_of_memory(exc: BaseException) -> bool:
    """Whether a start-up error is a device out of memory (OUT_OF_MEMORY_TEXTS)."""
    text = str(exc).lower()
    return any(phrase in text for phrase in OUT_OF_MEMORY_TEXTS)


def _apply_thread_count() -> None:
    """torch's threads from OMP_NUM_THREADS, which the pool sets per world
    size (W ranks share the cores: oversubscription costs more than it
    gives): the server this rank was forked from imported torch under the
    value of the pool it started for."""
    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _init_group(args, startup: dict):
    """The rank's DcpGroup; ``startup`` gets the seconds of its CUDA and group set-up."""
    import torch.distributed as dist

    from dcpcheck.group import DcpGroup
    from dcpcheck.ranks.placement import Placement

    _apply_thread_count()
    timeout = timedelta(seconds=args.collective_timeout)
    store = dist.FileStore(args.store, args.world_size)
    placement = Placement(args.device, args.world_size, args.gpus)
    device = placement.device(args.rank)
    if device.type == "cuda":  # NCCL or gloo (which moves CUDA tensors itself): kernels run here
        startup["cuda_init_s"] = _init_cuda(device)
    started = time.perf_counter()
    if placement.backend == "nccl":
        dist.init_process_group(
            "nccl", store=store, rank=args.rank, world_size=args.world_size, timeout=timeout, device_id=device
        )
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world_size, timeout=timeout)
        # A gloo group of its own, as vLLM's GroupCoordinator keeps one beside its device group
        # (distributed/parallel_state.py): a data collective issued on it is told apart (dsv41's coordinator).
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    startup["group_init_s"] = time.perf_counter() - started
    return DcpGroup(
        rank_in_group=args.rank,
        world_size=args.world_size,
        device=device,
        device_group=dist.group.WORLD,
        cpu_group=cpu_group,
    )


def _run_task(task: messages.RunCase, group, impl_spec: str):
    from dcpcheck import triton_interpreter
    from dcpcheck.coverage_context import switch as switch_coverage_context
    from dcpcheck.impls.registry import load_implementation
    from dcpcheck.ranks.rankfn import RankContext, run_rank_case

    for entry in reversed(task.sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    group.collective_calls = 0
    switch_coverage_context(task.case.nodeid)
    fn = pickle.loads(task.fn)
    impl = load_implementation(impl_spec)
    triton_interpreter.install()  # done once: where the zygote's server loaded the implementation, inherited
    ctx = RankContext(group=group, device=group.device, impl=impl, case=task.case)
    return run_rank_case(fn, ctx)


def stacks_path(tmpdir: str, rank: int) -> str:
    return os.path.join(tmpdir, f"stacks{rank}.txt")


def log_path(tmpdir: str, rank: int) -> str:
    return os.path.join(tmpdir, f"rank{rank}.log")


def redirect_output(path: str) -> None:
    """Stdout and stderr of this process to ``path``, from its start."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _end_pool(signum, frame) -> None:
    """The zygote's last act when pytest died: no rank, nothing a rank
    started, and no temporary directory is left."""
    for sig in (ORPHANED_SIGNAL, ORPHANED_GROUP_SIGNAL):
        signal.signal(sig, signal.SIG_IGN)  # the other one must not start this again midway
    kill_tree(os.getpid(), include_root=False)
    shutil.rmtree(_end_pool.tmpdir, ignore_errors=True)
    os._exit(128 + signum)


def zygote_main(args) -> int:
    _end_pool.tmpdir = args.tmpdir
    signal.signal(ORPHANED_SIGNAL, _end_pool)
    signal.signal(ORPHANED_GROUP_SIGNAL, _end_pool)
    die_with_parent(ORPHANED_SIGNAL, args.parent_pid)
    become_subreaper()
    conn = _connect(args.socket)
    conn.send(messages.ZygoteHello(os.getpid()))
    ranks = {}
    for rank in range(args.world_size):
        pid = os.fork()
        if pid == 0:
            conn.close()
            os._exit(_rank_main(args, rank, zygote_pid=os.getppid()))
        ranks[pid] = rank
    while ranks:
        pid, status = os.wait()
        if pid in ranks:
            conn.send(messages.RankExited(ranks.pop(pid), os.waitstatus_to_exitcode(status)))
    kill_tree(os.getpid(), include_root=False)  # what the ranks left behind, re-parented to this subreaper
    return 0


def _rank_main(args, rank: int, zygote_pid: int) -> int:
    try:
        for sig in (ORPHANED_SIGNAL, ORPHANED_GROUP_SIGNAL):
            signal.signal(sig, signal.SIG_DFL)  # the zygote's handlers are not the rank's
        die_with_parent(signal.SIGKILL, zygote_pid)  # a signal no busy loop can delay
        become_subreaper()
        redirect_output(log_path(args.tmpdir, rank))
        return rank_main(args, rank)
    except BaseException:  # noqa: BLE001 - a forked child must never return into the zygote's code
        import traceback

        traceback.print_exc()
        return 1


def rank_main(args, rank: int) -> int:
    args.rank = rank
    stacks = open(stacks_path(args.tmpdir, rank), "a", buffering=1)
    faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)

    conn = _connect(args.socket)
    conn.send(messages.RankHello(rank, os.getpid()))
    startup = {}
    try:
        group = _init_group(args, startup)
    except Exception as exc:
        from dcpcheck.ranks.rankfn import describe_exception

        conn.send(messages.RankFailedToStart(rank, describe_exception(exc), out_of_memory=_out_of_memory(exc)))
        raise
    conn.send(messages.RankReady(args.rank, os.getpid(), startup))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return 0
        if isinstance(task, messages.Stop):
            break
        conn.send(messages.CaseStarted())
        outcome = _run_task(task, group, args.impl)
        end_case_processes(before=set())  # a rank starts nothing itself: every descendant is the case's
        conn.send(outcome)

    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--tmpdir", required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--impl", required=True)
    parser.add_argument("--collective-timeout", type=float, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    return zygote_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
