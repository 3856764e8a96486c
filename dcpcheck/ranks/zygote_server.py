"""Pool zygotes forked from one process that imported torch once.

A pool's zygote (:mod:`dcpcheck.ranks.worker`) used to be a fresh
interpreter that imported torch and the implementation before it forked its
ranks: seconds of CPU for every pool (vLLM's import alone is over ten on a
busy GPU host), and a session starts many (every world size, and a fresh
pool after each case that leaves one broken). Here one *server* per
environment and implementation (``python -m dcpcheck.ranks.zygote_server``)
imports torch and loads the implementation once, and forks each zygote on
request; from there the zygote runs exactly as if it had been spawned (its
own process group, its log, its ``sys.argv``, the environment and working
directory of the request). An implementation whose loading initialises
CUDA's driver cannot be loaded there (no process forked after that can use
a GPU): the server says so and exits (:class:`ImplInitialisesCuda`), and
its ranks load it after their fork.

The self-tests' inner sessions are forked the same way (:class:`RunModule`:
``python -m MODULE ARGS`` in the request's directory, environment and
``sys.path``), from a server of their own per pytest process that imported
torch and pytest and froze those imports (``--freeze-imports``), so that a
session's full collections skip them (:mod:`tests.selftest.support.inner`).

The process tree stays bounded: the server gets the kernel's parent-death
signal when pytest dies and its zygotes get theirs when the server dies
(:func:`dcpcheck.ranks.reaper.die_with_parent`), and a zygote that gets it
ends its pool. The server reaps its zygotes, so pytest learns how one exited
by asking (:class:`ForkedZygote` answers as much of ``subprocess.Popen`` as a
pool uses). A server lives until :meth:`ZygoteServers.stop`, since its death
ends every pool it forked, or until it does not answer in time (stopped by a
debugger, starved by the host): then it is killed, and the wait fails saying
what ``/proc`` shows it doing.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from dcpcheck.ranks.launcher import LaunchError
from dcpcheck.ranks.procstate import describe_exit, describe_process
from dcpcheck.ranks.reaper import die_with_parent

PARENT_DEATH_SIGNAL = signal.SIGTERM  # the server's default action: end at once, and its zygotes get theirs
STOP_WAIT_S = 10.0  # at most, for a server to exit once its connection is closed
# Variables a zygote gets the request's value of, whose change needs no new
# server: set by pytest for each test phase, and the threads of a world
# size's ranks (each rank applies it itself: dcpcheck.ranks.worker).
PER_ZYGOTE_VARIABLES = ("PYTEST_CURRENT_TEST", "OMP_NUM_THREADS")


@dataclass(frozen=True)
class ServerReady:
    """The server's first message: it imported what every zygote needs, and
    loaded the implementation if asked. ``impl_initialised_cuda``: loading it
    initialised CUDA's driver, so the server forks nothing."""

    impl_initialised_cuda: bool = False


@dataclass(frozen=True)
class ForkZygote:
    """Fork a zygote that runs ``dcpcheck.ranks.worker`` with ``argv`` (less
    ``--parent-pid``: the server's), in ``cwd``, under ``environ``, its output to ``log``."""

    argv: list[str]
    cwd: str
    environ: dict[str, str]
    log: str

    def asked(self) -> str:
        return "to fork a zygote"


@dataclass(frozen=True)
class RunModule:
    """Fork a process that runs ``python -m module args`` as started in
    ``cwd`` under ``environ`` (``sys.path`` as those give it), its output to
    ``log``; it gets SIGKILL when the server dies."""

    module: str
    args: list[str]
    cwd: str
    environ: dict[str, str]
    log: str

    def asked(self) -> str:
        return f"to fork python -m {self.module}"


@dataclass(frozen=True)
class ExitCode:
    """How zygote ``pid`` exited (as ``Popen.returncode``), waiting at most
    ``timeout`` seconds; ``None`` while it runs."""

    pid: int
    timeout: float

    def asked(self) -> str:
        return f"how zygote {self.pid} exited"


class ZygoteServerGone(LaunchError):
    """The server ended, and with it every zygote it forked."""


class ZygoteServerNotAnswering(ZygoteServerGone):
    """The server did not answer in time, so it was killed, and with it every zygote it forked."""


class ImplInitialisesCuda(Exception):
    """Loading the implementation in the server initialised CUDA's driver:
    ranks forked from it could not use their GPU, so the server ended; its
    ranks must load it themselves, after their fork (no ``impl`` to the server)."""


# ---- the server ---------------------------------------------------------------


def _become(request: ForkZygote | RunModule) -> None:
    """In the forked child: the process group, directory, environment and
    output the request asks for, stdin /dev/null."""
    from dcpcheck.ranks.worker import redirect_output

    os.setpgid(0, 0)  # its own process group, as the pool's killpg expects
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.environ)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    redirect_output(request.log)


def _run_zygote(request: ForkZygote, parent_pid: int) -> int:
    """In the forked child: become the zygote a spawn would have started."""
    from dcpcheck.ranks import worker

    _become(request)
    argv = [*request.argv, "--parent-pid", str(parent_pid)]
    sys.argv = [worker.__file__, *argv]  # what `python -m dcpcheck.ranks.worker` shows an implementation
    return worker.main(argv)


def _run_module(request: RunModule, parent_pid: int) -> int:
    """In the forked child: ``python -m`` as the request asks; -> its exit code."""
    import atexit
    import runpy

    die_with_parent(signal.SIGKILL, parent_pid)
    _become(request)
    # sys.path as `python -m` from cwd with this PYTHONPATH has it: cwd, then PYTHONPATH's entries.
    entries = [request.cwd, *filter(None, request.environ.get("PYTHONPATH", "").split(os.pathsep))]
    sys.path[:] = entries + [entry for entry in sys.path[1:] if entry not in entries]
    sys.argv = [request.module, *request.args]
    try:
        runpy.run_module(request.module, run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, status 1
        import traceback

        traceback.print_exc()
        return 1
    finally:
        atexit._run_exitfuncs()  # what the run registered (e.g. a mutant's directory removed), as at exit
        sys.stdout.flush()
        sys.stderr.flush()


def _fork(request: ForkZygote | RunModule, conn: Connection) -> int:
    server_pid = os.getpid()
    run = _run_zygote if isinstance(request, ForkZygote) else _run_module
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            conn.close()
            code = run(request, server_pid)
        except BaseException:  # noqa: BLE001 - a forked child must never return into the server's loop
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    try:
        os.setpgid(pid, pid)  # here too, so the group exists before pytest can signal it
    except (PermissionError, ProcessLookupError):
        pass  # it already did (and may have exited)
    return pid


def _exit_code(pid: int, timeout: float, reaped: dict[int, int]) -> int | None:
    deadline = time.monotonic() + timeout
    while pid not in reaped:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            reaped[pid] = os.waitstatus_to_exitcode(status)
        elif time.monotonic() >= deadline:
            return None
        else:
            time.sleep(0.01)
    return reaped[pid]


def _load_impl(spec: str, device: str) -> bool:
    """Load the implementation every rank runs: -> whether that initialised
    CUDA's driver (only a CUDA pool's ranks are harmed by it). What it raises
    is left to the ranks, which report it with its traceback on first use."""
    from dcpcheck import triton_interpreter
    from dcpcheck.impls.registry import load_implementation

    try:
        load_implementation(spec)
    except Exception:  # noqa: BLE001 - each rank loads it again and reports the error
        pass
    triton_interpreter.install()  # the ranks forked from here inherit it
    if device == "cpu":
        return False
    from dcpcheck.ranks.cuda_driver import driver_initialised

    return driver_initialised()


def serve(conn: Connection, preload: list[str], impl: str | None, device: str, freeze_imports: bool = False) -> int:
    for module in preload:
        __import__(module)
    if impl is not None and _load_impl(impl, device):
        conn.send(ServerReady(impl_initialised_cuda=True))
        return 0
    if freeze_imports:
        # What is imported now is every fork's: the collections a fork makes (pytest
        # makes full ones as its session ends) skip it and copy none of its pages.
        gc.freeze()
    conn.send(ServerReady())
    reaped: dict[int, int] = {}
    while True:
        try:
            request = conn.recv()
        except EOFError:  # pytest is done with it
            return 0
        if isinstance(request, (ForkZygote, RunModule)):
            conn.send(_fork(request, conn))
        else:
            conn.send(_exit_code(request.pid, request.timeout, reaped))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True, help="this end of the connection to pytest")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--preload", nargs="*", default=[], help="modules every zygote needs")
    parser.add_argument("--impl", help="the implementation to load before forking (--dcp-impl's spec)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the ranks run")
    parser.add_argument("--freeze-imports", action="store_true", help="gc.freeze() what it imported, before forking")
    args = parser.parse_args(argv)
    die_with_parent(PARENT_DEATH_SIGNAL, args.parent_pid)
    return serve(Connection(args.fd), args.preload, args.impl, args.device, args.freeze_imports)


# ---- pytest's side ------------------------------------------------------------


@dataclass(frozen=True)
class ServerKind:
    """What a server is started with: its imports, and the implementation it
    loads (None: each rank loads it) for ranks on ``device``; ``freeze_imports``:
    it freezes them (``gc.freeze``; the self-tests' server, :class:`RunModule`)."""

    preload: tuple[str, ...]
    impl: str | None
    device: str
    freeze_imports: bool = False

    def command(self, fd: int) -> list[str]:
        command = [
            sys.executable, "-m", "dcpcheck.ranks.zygote_server", "--fd", str(fd),
            "--parent-pid", str(os.getpid()), "--device", self.device, "--preload", *self.preload,
        ]  # fmt: skip
        if self.freeze_imports:
            command.append("--freeze-imports")  # tools/cpu_profile.py knows the self-tests' server by it
        return command if self.impl is None else [*command, "--impl", self.impl]


class ZygoteServer:
    """One server process, started with ``environ``; ``startup_timeout``
    bounds its start-up (its imports, the implementation's load),
    ``answer_timeout`` (``--dcp-timeout``) each answer, beyond what the
    request itself waits."""

    def __init__(self, environ: dict[str, str], kind: ServerKind, startup_timeout: float, answer_timeout: float):
        started = time.perf_counter()
        self.answer_timeout = answer_timeout
        ours, theirs = socket.socketpair()
        command = kind.command(theirs.fileno())
        # Its own process group, like the zygotes': a Ctrl-C reaches pytest, which ends its pools itself.
        self.process = subprocess.Popen(
            command, env=environ, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, process_group=0,
        )  # fmt: skip
        theirs.close()
        self.conn = Connection(ours.detach())
        self.ending: str | None = None  # how it ended, once it has
        while not self.conn.poll(0.2):  # its ready message, or the end of its connection
            if time.perf_counter() - started > startup_timeout:
                doing = describe_process(self.process.pid)  # before the kill: what kept it from starting
                self.process.kill()  # stuck in its imports: nothing to wait for
                self.stop()
                raise ZygoteServerGone(
                    f"the zygote server {doing}: it did not start within --dcp-startup-timeout "
                    f"{startup_timeout:g} s: {self.ending}"
                )
        try:
            ready = self.conn.recv()
        except (EOFError, OSError):
            self.stop()
            raise ZygoteServerGone(
                f"the zygote server ended while it started, after {time.perf_counter() - started:.1f} s: {self.ending}"
            ) from None
        if ready.impl_initialised_cuda:
            self.stop()
            raise ImplInitialisesCuda(kind.impl)

    def _ask(self, request, waits: float = 0.0):
        """The answer to ``request``, which makes the server wait ``waits`` seconds."""
        limit = waits + self.answer_timeout
        try:
            self.conn.send(request)
            if self.conn.poll(limit):
                return self.conn.recv()
        except (EOFError, OSError):
            self.stop()
            raise ZygoteServerGone(
                f"the zygote server (pid {self.process.pid}) ended, and every pool it forked with it: {self.ending}"
            ) from None
        raise self._not_answering(request, limit)

    def _not_answering(self, request, limit: float) -> ZygoteServerNotAnswering:
        """Kill the server, which did not answer ``request`` within ``limit`` seconds: -> what to raise."""
        doing = describe_process(self.process.pid)  # before the kill: what kept it from answering
        self.process.kill()
        self.stop()
        return ZygoteServerNotAnswering(
            f"the zygote server {doing}: it did not answer {request.asked()} within {limit:g} s "
            f"(--dcp-timeout {self.answer_timeout:g} s), so it was killed, and every pool it forked with it"
        )

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def fork(self, argv: list[str], *, environ: dict[str, str], log: str) -> ForkedZygote:
        pid = self._ask(ForkZygote(argv, os.getcwd(), environ, log))
        return ForkedZygote(self, pid)

    def run_module(self, module: str, args: list[str], *, cwd: str, environ: dict[str, str], log: str) -> ForkedZygote:
        """``python -m module args`` forked (:class:`RunModule`)."""
        return ForkedZygote(self, self._ask(RunModule(module, args, cwd, environ, log)))

    def exit_code(self, pid: int, timeout: float) -> int | None:
        return self._ask(ExitCode(pid, timeout), waits=timeout)

    def stop(self) -> None:
        """Close its connection (it exits), kill it if it does not; note how it ended."""
        if self.ending is not None:
            return
        self.conn.close()
        try:
            self.process.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        output = self.process.stdout.read().decode(errors="replace").strip()
        self.process.stdout.close()
        self.ending = describe_exit(self.process.returncode)
        if output:
            self.ending += f"\n--- zygote server output ---\n{output}"


class ForkedZygote:
    """A zygote (or a :class:`RunModule` run) the server forked, seen as ``subprocess.Popen`` shows a child:
    ``pid``, ``poll()``, ``wait(timeout)``, ``returncode``. Once the server is
    gone they raise :class:`ZygoteServerGone`."""

    def __init__(self, server: ZygoteServer, pid: int):
        self.server, self.pid = server, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float) -> int:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"zygote {self.pid}", timeout)
        return self.returncode


class ZygoteServers:
    """The session's servers, one per environment and :class:`ServerKind` a pool asks for."""

    def __init__(self, preload: list[str], startup_timeout: float, answer_timeout: float):
        self.preload, self.startup_timeout, self.answer_timeout = tuple(preload), startup_timeout, answer_timeout
        self.servers: dict[tuple, ZygoteServer] = {}

    def fork(
        self, argv: list[str], *, environ: dict[str, str], log: str, impl: str | None, device: str
    ) -> ForkedZygote:
        """A zygote forked from the server of ``environ`` that loaded ``impl``
        (None: none) for ranks on ``device``; :class:`ImplInitialisesCuda` where loading it initialises CUDA."""
        kind = ServerKind(self.preload, impl, device)
        key = (kind, frozenset((name, value) for name, value in environ.items() if name not in PER_ZYGOTE_VARIABLES))
        server = self.servers.get(key)
        if server is None or not server.alive:
            if server is not None:
                server.stop()
            self.servers.pop(key, None)
            server = ZygoteServer(environ, kind, self.startup_timeout, self.answer_timeout)
            self.servers[key] = server
        return server.fork(argv, environ=environ, log=log)

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.servers.clear()


if __name__ == "__main__":
    # As the module, not __main__: the messages pickle under one name on both sides.
    from dcpcheck.ranks import zygote_server

    code = zygote_server.main()
    # Its output is pytest's to read; beyond that, nothing is left to release,
    # and the finalization of an interpreter with torch loaded would delay
    # every session's end.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
