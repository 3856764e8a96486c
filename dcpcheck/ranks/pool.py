"""A persistent pool of spawned rank processes for one world size.

The pool is started once and reused by every test of that world size. All
workers share one OS process group, so a stuck case is ended by one
``killpg``: no worker, and nothing a worker started, is left behind. Ranks
meet through a FileStore in a private temporary directory (no port), so
several pytest processes (xdist) each run their own pools side by side.

The pool offers the steps of its life cycle (start, run, kill, stop);
:class:`dcpcheck.ranks.spawned.SpawnedRanks` decides when each is taken.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path

from dcpcheck.ranks.host_threads import share_host_cores
from dcpcheck.ranks.launcher import PEER_GRACE_S, Case, CaseResult, LaunchError
from dcpcheck.ranks.messages import (
    CaseStarted,
    RankExited,
    RankFailedToStart,
    RankHello,
    RankReady,
    RunCase,
    Stop,
    ZygoteHello,
)
from dcpcheck.ranks.native_stacks import native_stack
from dcpcheck.ranks.placement import Placement
from dcpcheck.ranks.procstate import describe_exit, describe_process, process_state_letter
from dcpcheck.ranks.rankfn import MAX_ERROR_CHARS, bounded
from dcpcheck.ranks.reaper import kill_tree
from dcpcheck.ranks.worker import STACK_SIGNAL, log_path, stacks_path
from dcpcheck.ranks.zygote_server import ForkedZygote, ZygoteServerGone, ZygoteServerNotAnswering, ZygoteServers

STACK_WAIT_S = 3.0  # at most, for stuck ranks to write their Python stacks
EXIT_REPORT_WAIT_S = 2.0  # at most, for the zygote to report how a rank that hung up exited
STOP_WAIT_S = 10.0  # at most, for the ranks to leave their group and exit when asked to
LOG_TAIL_LINES = 40


class PoolOutOfMemory(LaunchError):
    """A rank could not start for want of device memory (RankFailedToStart's
    ``out_of_memory``): memory that other pools, or other processes, hold."""


class RankGoneBeforeCase(Exception):
    """A rank's process ended before it started the case sent to it: it died
    between cases (while it waited for this task), so the case did not run
    there, and a fresh pool can run it."""

    def __init__(self, rank: int, how: str):
        super().__init__(f"rank {rank} {how}")
        self.rank, self.how = rank, how


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log, at most MAX_ERROR_CHARS of them (a
    rank may print megabytes on one line)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.fstat(fh.fileno()).st_size - 4 * MAX_ERROR_CHARS))
            text = fh.read().decode(errors="replace")
    except OSError:
        return ""
    return bounded("\n".join(text.splitlines()[-lines:]))


class RankPool:
    def __init__(
        self,
        placement: Placement,
        *,
        impl_spec: str,
        startup_timeout: float,
        collective_timeout: float,
        zygotes: ZygoteServers,
        preload_impl: bool,
    ):
        self.placement = placement
        self.preload_impl = preload_impl
        self.world_size = placement.world_size
        self.device = placement.device_type
        self.impl_spec = impl_spec
        self.startup_timeout = startup_timeout
        self.collective_timeout = collective_timeout
        self.zygotes = zygotes
        self.zygote: ForkedZygote | None = None
        self.zygote_conn: Connection | None = None
        self.conns: dict[int, Connection] = {}
        self.pids: dict[int, int] = {}
        self.joining: dict[Connection, int] = {}  # during start-up: the ranks connected and not yet in their group
        self.exit_codes: dict[int, int] = {}
        self.tmpdir: Path | None = None
        self.out_of_memory = False  # a rank failed to start for want of device memory
        # Where start() spent its time: pool_start_s (all of it), and the
        # slowest rank's cuda_init_s and group_init_s.
        self.startup: dict[str, float] = {}

    # ---- life cycle ------------------------------------------------------
    @property
    def alive(self) -> bool:
        """No process of the pool has exited, and no rank's connection is
        readable: between cases a rank sends nothing, so one that is has hung up.
        A server that did not answer is no ended pool: its ZygoteServerNotAnswering
        goes to the caller, and fails the case that waited on it."""
        self._collect_exits()
        try:
            if self.zygote is None or self.zygote.poll() is not None or self.exit_codes:
                return False
            return not any(conn.poll(0) for conn in self.conns.values())
        except ZygoteServerNotAnswering:
            raise
        except (OSError, ZygoteServerGone):
            return False

    def _log(self, rank: int) -> Path:
        return Path(log_path(str(self.tmpdir), rank))

    def _worker_env(self) -> dict:
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(
            [package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        env["PYTHONUNBUFFERED"] = "1"
        if self.device == "cpu":
            env["TRITON_INTERPRET"] = "1"
            env["CUDA_VISIBLE_DEVICES"] = ""
            env["OMP_NUM_THREADS"] = "1"
        else:
            # Host-side work (scenarios, oracle) of every rank of every xdist
            # worker shares the cores (oversubscribed OpenMP made cases several times slower).
            workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
            share_host_cores(env, processes=workers * self.world_size)
            # Ranks sharing a GPU: segments that grow in place keep what a rank
            # reserves close to what it allocates (fixed segments fragmented
            # to 1.7x at the realistic prefill shapes).
            env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        return env

    def start(self) -> None:
        """Start the zygote and its ranks and wait until they formed their
        group. On failure, what did start is left running: kill it."""
        started = time.perf_counter()
        self.tmpdir = Path(tempfile.mkdtemp(prefix="dcpcheck-pool-"))
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(self.tmpdir / "sock"))
        server.listen(self.world_size + 1)
        server.settimeout(0.2)
        argv = [
            "--socket", str(self.tmpdir / "sock"),
            "--store", str(self.tmpdir / "store"),
            "--tmpdir", str(self.tmpdir),
            "--world-size", str(self.world_size),
            "--device", self.device,
            "--gpus", str(self.placement.gpus),
            "--impl", self.impl_spec,
            "--collective-timeout", str(self.collective_timeout),
        ]  # fmt: skip
        try:
            # In a process group of its own: the ranks it forks inherit it, so one killpg ends them all.
            try:
                self.zygote = self.zygotes.fork(
                    argv,
                    environ=self._worker_env(),
                    log=str(self.tmpdir / "zygote.log"),
                    impl=self.impl_spec if self.preload_impl else None,
                    device=self.device,
                )
            except ZygoteServerGone as exc:
                self._startup_failed(started, "fork", [str(exc)])
            self._handshake(server, started)
        finally:
            server.close()
        self.startup["pool_start_s"] = time.perf_counter() - started

    def _handshake(self, server: socket.socket, started: float) -> None:
        """Each connection names itself as soon as it is accepted: the
        zygote's comes first in practice, and from then on a rank that dies
        during start-up is reported at once (the zygote reports its exit), and
        one whose group set-up raises sends its error first."""
        while len(self.conns) < self.world_size or self.zygote_conn is None:
            self._check_started(started, "connect")
            try:
                sock, _ = server.accept()
            except TimeoutError:
                continue
            sock.setblocking(True)
            conn = Connection(sock.detach())
            message = self._recv_startup(conn, started, "connect")
            if isinstance(message, ZygoteHello):
                self.zygote_conn = conn
            else:
                self.conns[message.rank], self.pids[message.rank] = conn, message.pid
                self.joining[conn] = message.rank
        while self.joining:  # in whatever order the ranks get ready: one that fails is heard at once
            self._check_started(started, "ready")
            for conn in wait(list(self.joining), timeout=0.2):
                message = self._recv_startup(conn, started, "ready", rank=self.joining.pop(conn))
                for phase, seconds in message.startup.items():
                    self.startup[phase] = max(seconds, self.startup.get(phase, 0.0))

    def _recv_startup(self, conn: Connection, started: float, phase: str, rank: int | None = None):
        expected = (ZygoteHello, RankHello) if phase == "connect" else (RankReady,)
        while not conn.poll(0.2):
            self._check_started(started, phase)
        try:
            message = conn.recv()
        except (EOFError, OSError):
            if rank is None:
                self._startup_failed(started, phase, ["a pool process closed its connection before naming itself"])
            self._await_exit(rank)
            code = self.exit_codes.get(rank)
            self._startup_failed(
                started,
                phase,
                [f"rank {rank} " + (describe_exit(code) if code is not None else "closed its connection")],
            )
        if isinstance(message, RankFailedToStart):
            self.out_of_memory |= message.out_of_memory
            self._startup_failed(started, phase, [f"rank {message.rank} failed while starting: {message.error}"])
        if not isinstance(message, expected):
            names = " or ".join(kind.__name__ for kind in expected)
            raise LaunchError(f"worker sent {message!r} during start-up, expected {names}")
        return message

    def _check_started(self, started: float, phase: str) -> None:
        """Raise LaunchError when a pool process exited or start-up took too long."""
        self._collect_exits()
        try:
            zygote_code = self.zygote.poll()
        except ZygoteServerGone as exc:
            self._startup_failed(started, phase, [str(exc)])
        what = [self._describe_start_exit(rank, code) for rank, code in sorted(self.exit_codes.items())]
        if zygote_code is not None:
            what.append(f"the zygote {describe_exit(zygote_code)}")
        if not what and time.perf_counter() - started > self.startup_timeout:
            what.append(
                f"timed out (--dcp-startup-timeout {self.startup_timeout:g} s) waiting for " + self._waited_for()
            )
        if what:
            self._startup_failed(started, phase, what)

    def _waited_for(self) -> str:
        """What start-up still waits for, then what ``/proc`` shows each of those processes doing."""
        waited, doing = [], []
        unconnected = [rank for rank in range(self.world_size) if rank not in self.conns]
        joining = sorted(self.joining.values())
        if self.zygote_conn is None:
            waited.append("the zygote to connect")
        if unconnected:
            waited.append(f"ranks {unconnected} to connect")
        if joining:
            waited.append(f"ranks {joining} to join their group")
        if self.zygote_conn is None or unconnected:  # the zygote forks the ranks
            doing.append(f"the zygote {describe_process(self.zygote.pid)}")
        doing += [f"rank {rank} {describe_process(self.pids[rank])}" for rank in joining]
        return ", ".join(waited) + ": " + ", ".join(doing)

    def _describe_start_exit(self, rank: int, code: int) -> str:
        """How a rank that exited during start-up ended, with the error it sent, if any."""
        conn = self.conns.get(rank)
        try:
            while conn is not None and conn.poll(0):
                message = conn.recv()
                if isinstance(message, RankFailedToStart):
                    self.out_of_memory |= message.out_of_memory
                    return f"rank {rank} failed while starting: {message.error} ({describe_exit(code)})"
        except (EOFError, OSError):
            pass
        return f"rank {rank} {describe_exit(code)}"

    def _startup_failed(self, started: float, phase: str, what: list[str]):
        logs = [f"--- zygote log ---\n{_tail(self.tmpdir / 'zygote.log')}"]
        logs += [f"--- rank {r} log ---\n{_tail(self._log(r))}" for r in range(self.world_size)]
        raise (PoolOutOfMemory if self.out_of_memory else LaunchError)(
            f"could not start {self.world_size} ranks ({self.placement.describe()}; {phase} phase) "
            f"after {time.perf_counter() - started:.1f} s: " + "; ".join(what) + "\n" + "\n".join(logs)
        )

    def _collect_exits(self, wait_s: float = 0.0) -> None:
        """Read the zygote's reports of ranks that exited."""
        conn = self.zygote_conn
        try:
            while conn is not None and conn.poll(wait_s):
                exited: RankExited = conn.recv()
                self.exit_codes[exited.rank] = exited.code
                wait_s = 0.0
        except (EOFError, OSError):
            pass

    def stop(self) -> None:
        """Ask the ranks to leave their group and exit; kill what lingers."""
        if self.zygote is None:
            return
        for conn in self.conns.values():
            try:
                conn.send(Stop())
            except OSError:
                pass
        try:
            self.zygote.wait(STOP_WAIT_S)
        except (subprocess.TimeoutExpired, ZygoteServerGone):
            pass
        self.kill()

    def kill(self) -> None:
        """Kill the zygote, every rank and anything they started, at once."""
        if self.zygote is not None:
            # The zygote's tree first: a process a rank started in a new
            # session is outside the process group.
            kill_tree(self.zygote.pid, include_root=False)
            try:
                os.killpg(self.zygote.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.zygote.wait(STOP_WAIT_S)  # killed, it ends at once, unless in an uninterruptible wait
            except (subprocess.TimeoutExpired, ZygoteServerGone):
                pass  # stuck in the kernel, or ended by its server's death (and reaped by init)
            self.zygote = None
        for conn in list(self.conns.values()) + [self.zygote_conn]:
            if conn is not None:
                conn.close()
        self.conns, self.pids, self.zygote_conn = {}, {}, None
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None

    # ---- running a case --------------------------------------------------
    def run(self, fn, case: Case) -> CaseResult:
        """One case on every rank. A result with stuck or dead ranks leaves the
        pool unusable (its group is broken): its owner kills it."""
        task = RunCase(pickle.dumps(fn), case, list(sys.path))
        started = time.perf_counter()
        result = CaseResult(self.world_size)
        for rank, conn in self.conns.items():
            try:
                conn.send(task)
            except OSError:  # a broken pipe: it hung up before this case
                raise RankGoneBeforeCase(rank, self._death(rank)) from None
        pending = set(self.conns)
        began = set()  # ranks that said they started the case
        deadline = started + case.timeout
        first_failure = None
        by_conn = {conn: rank for rank, conn in self.conns.items()}
        while pending:
            now = time.perf_counter()
            limit = deadline if first_failure is None else min(deadline, first_failure + PEER_GRACE_S)
            if now >= limit:
                result.timed_out = first_failure is None
                break
            for conn in wait([self.conns[r] for r in pending], timeout=min(0.2, limit - now)):
                rank = by_conn[conn]
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    if rank not in began:
                        raise RankGoneBeforeCase(rank, self._death(rank)) from None
                    pending.discard(rank)
                    result.dead[rank] = self._death(rank)
                    first_failure = first_failure or time.perf_counter()
                    continue
                if isinstance(message, CaseStarted):
                    began.add(rank)
                    continue
                pending.discard(rank)
                result.outcomes[rank] = message
                if not message.ok and first_failure is None:
                    first_failure = time.perf_counter()
            self._collect_exits()
            for rank in sorted(pending & set(self.exit_codes)):
                outcome = self._unread_messages(rank, began)
                if rank not in began:
                    raise RankGoneBeforeCase(rank, self._death(rank))
                pending.discard(rank)
                if outcome is not None:  # it reported, then exited: the case has its result
                    result.outcomes[rank] = outcome
                    continue
                result.dead[rank] = self._death(rank)
                first_failure = first_failure or time.perf_counter()
        if pending:
            result.stuck = self.dump_stacks(sorted(pending))
        result.seconds = time.perf_counter() - started
        return result

    def _unread_messages(self, rank: int, began: set):
        """What an exited rank sent before it exited and nobody has read yet:
        its start of the case (added to ``began``), then its outcome (returned), else None."""
        conn = self.conns[rank]
        try:
            while conn.poll(0):
                message = conn.recv()
                if not isinstance(message, CaseStarted):
                    return message
                began.add(rank)
        except (EOFError, OSError):
            pass
        return None

    def _await_exit(self, rank: int) -> None:
        """Until the zygote reported how ``rank`` exited, at most EXIT_REPORT_WAIT_S."""
        deadline = time.perf_counter() + EXIT_REPORT_WAIT_S
        while rank not in self.exit_codes and time.perf_counter() < deadline:
            self._collect_exits(wait_s=0.1)

    def _death(self, rank: int) -> str:
        self._await_exit(rank)
        how = describe_exit(self.exit_codes[rank]) if rank in self.exit_codes else "closed its connection"
        return f"{how}{self._zygote_fate()}\n--- rank {rank} log (tail) ---\n{_tail(self._log(rank))}"

    def _zygote_fate(self) -> str:
        """Why the zygote did not report a rank's exit: it ended, or its server did; else nothing."""
        try:
            code = self.zygote.poll()
        except ZygoteServerGone as gone:
            return f"; {gone}"
        return "" if code is None else f"; the zygote {describe_exit(code)}"

    def dump_stacks(self, ranks: list[int]) -> dict:
        """The Python stacks of ``ranks``, read through faulthandler; a
        stopped rank cannot write one, and is said to be stopped."""
        stopped = {r: describe_process(self.pids[r]) for r in ranks if process_state_letter(self.pids[r]) in ("T", "t")}
        ranks = [r for r in ranks if r not in stopped]
        offsets = {}
        for rank in ranks:
            path = Path(stacks_path(str(self.tmpdir), rank))
            offsets[rank] = path.stat().st_size if path.exists() else 0
            try:
                os.kill(self.pids[rank], STACK_SIGNAL)
            except ProcessLookupError:
                pass
        if offsets:
            self._wait_for_stacks(offsets)
        stacks = {rank: f"(no stack: the process {how})" for rank, how in stopped.items()}
        for rank in ranks:
            with open(stacks_path(str(self.tmpdir), rank), errors="replace") as fh:
                fh.seek(offsets[rank])
                text = fh.read(4 * MAX_ERROR_CHARS).strip()
            stacks[rank] = (
                bounded(text) if text else "(no stack: the process " + describe_process(self.pids[rank]) + ")"
            )
            native = native_stack(self.pids[rank])
            if native is not None:
                stacks[rank] += f"\n--- rank {rank} native stack (py-spy dump --native) ---\n{bounded(native)}"
        return dict(sorted(stacks.items()))

    def _wait_for_stacks(self, offsets: dict) -> None:
        """Until every rank's stack file has grown and stopped growing (a dump
        comes thread by thread), at most STACK_WAIT_S: a loaded host (many
        xdist workers) can take longer than any fixed pause."""
        deadline = time.perf_counter() + STACK_WAIT_S
        sizes = None
        while time.perf_counter() < deadline:
            time.sleep(0.2)
            latest = {rank: os.path.getsize(stacks_path(str(self.tmpdir), rank)) for rank in offsets}
            if latest == sizes and all(latest[rank] > offsets[rank] for rank in offsets):
                return
            sizes = latest
