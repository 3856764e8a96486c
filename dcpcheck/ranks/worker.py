"""The processes of a spawned pool.

:mod:`dcpcheck.ranks.pool` starts one *zygote* (``python -m
dcpcheck.ranks.worker``), which imports torch and the implementation once and
then forks the W ranks: each rank joins the process group once and runs the
rank functions the pytest process sends it until told to stop. The zygote
reports how each rank exited. Every process exits by itself when its parent
dies, so nothing outlives a session.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import pickle
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Connection

STACK_SIGNAL = signal.SIGUSR1


def _exit_when_orphaned(parent_pid: int) -> None:
    # A worker stuck in a collective never reads its socket again; polling
    # the parent is what guarantees no orphan survives a killed pytest.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)


def _connect(path: str) -> Connection:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return Connection(sock.detach())


def _init_group(args):
    import torch
    import torch.distributed as dist

    from dcpcheck.ranks.group import DcpGroup

    timeout = timedelta(seconds=args.collective_timeout)
    store = dist.FileStore(args.store, args.world_size)
    if args.device == "cuda":
        device = torch.device("cuda", args.rank)
        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl", store=store, rank=args.rank, world_size=args.world_size, timeout=timeout, device_id=device
        )
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # W ranks share few cores: oversubscription costs more than it gives
        dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world_size, timeout=timeout)
        cpu_group = dist.group.WORLD
    return DcpGroup(
        rank_in_group=args.rank,
        world_size=args.world_size,
        device=device,
        device_group=dist.group.WORLD,
        cpu_group=cpu_group,
    )


def _run_task(task: dict, group):
    from dcpcheck.impls.registry import load_implementation
    from dcpcheck.ranks.rankfn import RankContext, run_rank_case

    for entry in reversed(task["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    group.collective_calls = 0
    fn = pickle.loads(task["fn"])
    impl = load_implementation(task["impl"])
    ctx = RankContext(group=group, device=group.device, impl=impl, seed=task["seed"], case=task["case"])
    return run_rank_case(fn, ctx)


def stacks_path(tmpdir: str, rank: int) -> str:
    return os.path.join(tmpdir, f"stacks{rank}.txt")


def log_path(tmpdir: str, rank: int) -> str:
    return os.path.join(tmpdir, f"rank{rank}.log")


def _preload(args) -> None:
    """Import what every rank needs once, before forking (copy-on-write)."""
    import torch.distributed  # noqa: F401

    if args.device == "cpu":  # on CUDA, nothing that could initialise the driver before fork
        from dcpcheck.impls.registry import load_implementation

        try:
            load_implementation(args.impl)
        except Exception:  # noqa: BLE001 - the rank reports it, with its traceback, on first use
            pass


def _redirect_output(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def zygote_main(args) -> int:
    threading.Thread(target=_exit_when_orphaned, args=(args.parent_pid,), daemon=True).start()
    _preload(args)
    conn = _connect(args.socket)
    conn.send(("zygote", os.getpid()))
    ranks = {}
    for rank in range(args.world_size):
        pid = os.fork()
        if pid == 0:
            conn.close()
            os._exit(_rank_main(args, rank))
        ranks[pid] = rank
    while ranks:
        pid, status = os.wait()
        if pid in ranks:
            conn.send(("exit", ranks.pop(pid), os.waitstatus_to_exitcode(status)))
    return 0


def _rank_main(args, rank: int) -> int:
    try:
        _redirect_output(log_path(args.tmpdir, rank))
        return rank_main(args, rank)
    except BaseException:  # noqa: BLE001 - a forked child must never return into the zygote's code
        import traceback

        traceback.print_exc()
        return 1


def rank_main(args, rank: int) -> int:
    args.rank = rank
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    stacks = open(stacks_path(args.tmpdir, rank), "a", buffering=1)
    faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)

    conn = _connect(args.socket)
    conn.send(("hello", rank, os.getpid()))
    group = _init_group(args)
    conn.send(("ready", args.rank, os.getpid()))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return 0
        if task["op"] == "stop":
            break
        conn.send(_run_task(task, group))

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
    parser.add_argument("--impl", required=True)
    parser.add_argument("--collective-timeout", type=float, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    return zygote_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
