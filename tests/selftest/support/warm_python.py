"""``python -m MODULE ARGS`` for the self-tests' inner sessions, forked from
an interpreter that has imported torch and pytest already: each inner
session's start costs a fork, not an interpreter start and torch's import
(seconds of CPU each, most of what a short inner session costs).

One server per pytest process (each xdist worker its own), started at the
first run and ended with that process: the kernel kills it when its parent
dies, and each run's process when the server dies. Of dcpcheck it imports
only the reaper, not the plugin (the inner session's pytest rewrites the
plugin's asserts as it loads it), and no Triton (whose interpreter is chosen
at import). A run is a
fork in a process group of its own, given the session's directory,
environment and ``sys.path`` as ``python -m`` from that directory would have
them, its output written to a file. Sessions whose checks need a process
started the usual way (signals, process groups, what is left behind) use
:func:`tests.selftest.support.inner.start_inner_pytest`.

    python tests/selftest/support/warm_python.py     # the server: one JSON request a line on stdin
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

from dcpcheck.ranks.reaper import die_with_parent

SERVER = Path(__file__)
PRELOAD = ("torch", "pytest")


class WarmPythonGone(RuntimeError):
    """The server ended: a run could not be started or its exit code read."""


class WarmPython:
    """Client of one server (:func:`warm_python`)."""

    def __init__(self, env: dict[str, str]):
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVER), str(os.getpid())],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def run_module(
        self, module: str, args: list[str], *, cwd: Path, env: dict[str, str], timeout: float
    ) -> tuple[int | None, str]:
        """-> (exit code, output) of ``python -m module args`` run in ``cwd``
        with ``env``; exit code None when it did not end within ``timeout`` s (it is killed)."""
        output = cwd / f".warm-python-{os.getpid()}.out"
        request = {"module": module, "args": args, "cwd": str(cwd), "env": env, "output": str(output)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pid = self._answer(None)["pid"]
        try:
            code = self._answer(timeout)["code"]
        except TimeoutError:
            _kill_group(pid)
            self._answer(None)
            code = None
        text = output.read_text(errors="replace")
        output.unlink()
        return code, text

    def _answer(self, timeout: float | None) -> dict:
        if timeout is not None and not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            raise WarmPythonGone(f"the warm interpreter ({SERVER}) {_ended(self.proc)}")
        return json.loads(line)

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def _ended(proc: subprocess.Popen) -> str:
    code = proc.wait()
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # not yet in its own group, or gone
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


_server: WarmPython | None = None


def warm_python(env: dict[str, str]) -> WarmPython:
    """This process's server, started with ``env`` at the first call (the
    environment that runs share: each run sets its own in full)."""
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = WarmPython(env)
        atexit.register(_server.stop)
    return _server


# ---- the server ---------------------------------------------------------------


def _run(request: dict) -> int:
    """In the forked child: ``python -m`` as the request asks; -> its exit code."""
    os.setpgid(0, 0)
    die_with_parent(signal.SIGKILL, os.getppid())
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    fd = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdin = open(os.devnull)
    # sys.path as `python -m` from cwd with this PYTHONPATH has it: cwd, then PYTHONPATH's entries.
    entries = [request["cwd"], *filter(None, request["env"].get("PYTHONPATH", "").split(os.pathsep))]
    sys.path[:] = entries + [entry for entry in sys.path[1:] if entry not in entries]
    sys.argv = [request["module"], *request["args"]]
    import runpy

    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
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


def serve(parent_pid: int) -> None:
    die_with_parent(signal.SIGKILL, parent_pid)
    for module in PRELOAD:
        __import__(module)
    # What is imported now is every run's: the collections a run makes (pytest
    # makes full ones as its session ends) skip it and copy none of its pages.
    gc.freeze()
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            os._exit(_run(json.loads(line)))
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder: a run's modules come from its own sys.path
    serve(int(sys.argv[1]))
