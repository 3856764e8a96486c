"""Launching the GPU CI's sessions (``tools/gpu_ci.py``): each session's
command line (pytest, its xdist workers, or a ``torchrun`` job) and running
them, a wave at a time, their output prefixed with their names, stopped by
``--session-timeout``."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from gpu_ci_load import LoadSampler, WaveLoad
from gpu_ci_plugin import PLUGIN
from gpu_ci_sessions import Session
from session_cut import PROGRESS_ENV


def default_workers(gpus: int, cores: int) -> int:
    """xdist workers for the pool session: each starts a pool per world size
    (1 + 2 + 4 + 8 ranks, a CUDA context each) on the shared GPUs, so not
    more than 5 per GPU (on one H200, 8 workers ran it out of memory at pool
    starts, beside the realistic cases), and 3 cores each; 8 at most."""
    return max(1, min(8, 5 * max(gpus, 1), cores // 3))


def _xdist_keeps_order() -> list[str]:
    """pytest-xdist >= 3.7 reorders groups by test count unless told not to."""
    try:
        major, minor = (int(part) for part in metadata.version("pytest-xdist").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return []
    return ["--no-loadscope-reorder"] if (major, minor) >= (3, 7) else []


def session_workers(args, session: Session) -> int:
    """How many cases the session runs at once: its xdist workers (1 without xdist; a torchrun job runs its
    cases one after another)."""
    return 1 if session.torchrun else max(1, int(args.workers * session.workers_share))


def session_argv(args, session: Session, paths: list[str], junit: Path, *, gpus: int) -> list[str]:
    pytest = [
        "-m", "pytest", *paths, "-q", "-rfE", "-p", "no:cacheprovider", "-p", PLUGIN,
        "--device", args.device, "--dcp-timeout", str(args.dcp_timeout), "--junitxml", str(junit),
        *(["--world-sizes", args.world_sizes] if args.world_sizes else []),
        *(["-x"] if args.fail_fast else []), *session.extra_args, *args.pytest_args,
    ]  # fmt: skip
    if session.torchrun:
        ranks = max(gpus, 2)  # on one GPU the torchrun ranks share it over gloo
        # --standalone picks a free rendezvous port, so two jobs can run at once.
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *pytest]
    workers = session_workers(args, session)
    if workers > 1:
        # A test file (a realistic one: each half) stays on one xdist worker,
        # whose ranks then build each shared scenario once (tests/conftest.py).
        pytest += ["-n", str(workers), "--dist", "loadgroup", *_xdist_keeps_order()]
    return [sys.executable, *pytest]


@dataclass
class SessionRun:
    name: str
    argv: list[str]
    env: dict
    cwd: Path  # the checkout it runs in
    wave: int = 0
    steps: tuple[str, ...] = ()  # the steps it runs
    workers: int = 1  # cases it runs at once (session_workers)
    code: int | None = None
    seconds: float = 0.0
    timed_out: bool = False  # stopped by --session-timeout

    @property
    def progress(self) -> Path:
        """Where its cases' starts and ends are written (tools/session_cut.py)."""
        return Path(self.env[PROGRESS_ENV])


# After the time-out's SIGINT, this long for pytest to stop and write its JUnit XML, then SIGKILL.
STOP_GRACE_S = 60.0


def _kill(run: SessionRun, proc: subprocess.Popen, lock: threading.Lock) -> None:
    if proc.poll() is None:
        with lock:
            print(f"=== {run.name}: still running {STOP_GRACE_S:g} s after SIGINT: killing it (SIGKILL)", flush=True)
        proc.kill()


def _stop(run: SessionRun, proc: subprocess.Popen, timeout: float, lock: threading.Lock) -> None:
    run.timed_out = True
    with lock:
        print(f"=== {run.name}: --session-timeout {timeout:g} s reached: stopping it (SIGINT)", flush=True)
    proc.send_signal(signal.SIGINT)
    killer = threading.Timer(STOP_GRACE_S, _kill, (run, proc, lock))
    killer.daemon = True
    killer.start()


def _sigint_stops_it() -> None:
    """In the session, before its Python starts: SIGINT's default action, so that Python installs its
    KeyboardInterrupt handler (a run started in the background, as CI or nohup starts one, inherits SIGINT
    ignored, and a session would sleep through the time-out's SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stream(run: SessionRun, out: Path, lock: threading.Lock, timeout: float | None) -> None:
    """Run one session, its output on stdout (prefixed with its name) and in ``<out>/<name>.log``.
    After ``timeout`` seconds it gets SIGINT: pytest then stops and still writes its JUnit XML."""
    with lock:
        print(f"\n=== {run.name}: {' '.join(run.argv)}", flush=True)
    started = time.perf_counter()
    with open(out / f"{run.name}.log", "w") as log:
        proc = subprocess.Popen(
            run.argv,
            cwd=run.cwd,
            env=run.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=_sigint_stops_it,
        )
        timer = threading.Timer(timeout, _stop, (run, proc, timeout, lock)) if timeout else None
        if timer:
            timer.start()
        for line in proc.stdout:
            log.write(line)
            with lock:
                sys.stdout.write(f"[{run.name}] {line}")
        run.code = proc.wait()
        if timer:
            timer.cancel()
    run.seconds = time.perf_counter() - started
    with lock:
        print(f"=== {run.name}: exit {run.code} in {run.seconds:.1f} s", flush=True)


@dataclass
class Wave:
    seconds: float
    load: WaveLoad  # the host's cores and GPU memory meanwhile (gpu_ci_load.py)


def run_sessions(runs: list[SessionRun], out: Path, timeout: float | None, gpus: int) -> dict[int, Wave]:
    """Each wave's sessions at once (they share the GPUs and the cores), the
    waves in turn -> each wave's wall seconds and load."""
    lock = threading.Lock()
    waves = {}
    (out / "load.csv").unlink(missing_ok=True)  # this run's samples only: the sampler appends each wave's
    for wave in sorted({run.wave for run in runs}):
        started = time.perf_counter()
        threads = [threading.Thread(target=_stream, args=(run, out, lock, timeout)) for run in runs if run.wave == wave]
        with LoadSampler(gpus, out / "load.csv", wave) as load:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        waves[wave] = Wave(time.perf_counter() - started, load)
    return waves
