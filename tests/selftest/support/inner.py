"""Run an inner pytest session in a subprocess, for checks of the harness
itself (usage errors, skips, what a session leaves behind).

Sessions that need only an exit code and output (:func:`run_python_module`)
are forked from a warm interpreter, a zygote server
(:mod:`dcpcheck.ranks.zygote_server`, :class:`RunModule`) that imported
torch and pytest: each costs a fork, not an interpreter start and torch's
import. One server per pytest process (each xdist worker its own), started
at the first run and ended with that process. Of dcpcheck it imports only
the zygote server's modules, not the plugin (the inner session's pytest
rewrites the plugin's asserts as it loads it), and no Triton (whose
interpreter is chosen at import). Sessions whose checks need a process
started the usual way (signals, process groups, what is left behind) use
:func:`start_inner_pytest`."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from dcpcheck.ranks.zygote_server import ServerKind, ZygoteServer
from tests.selftest.support import session_probe

REPO_ROOT = Path(__file__).resolve().parents[3]
INNER_CONFTEST = 'pytest_plugins = ["dcpcheck.plugin"]\n'


WARM_SERVER = ServerKind(preload=("torch", "pytest"), impl=None, device="cpu", freeze_imports=True)
WARM_SERVER_STARTUP_TIMEOUT_S = 240.0  # its imports, on a busy machine
WARM_SERVER_ANSWER_TIMEOUT_S = 60.0  # beyond what a request waits
KILLED_RUN_WAIT_S = 60.0  # for a run killed at its timeout to be reaped
_warm_server: ZygoteServer | None = None

# pytest prints the short summary's messages whole where these are set (CI runs): an inner session's output
# is read the same on a developer's machine and in CI.
CI_MARKERS = ("CI", "BUILD_NUMBER")


def inner_env(**overrides) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DSV41_")) and k not in CI_MARKERS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env.update(overrides)
    return env


def default_placement(world_size: int) -> str:
    """The header's device of an inner session run with the default --device
    (auto) on this host: ``cpu/gloo``, ``cuda/nccl`` or ``cuda/gloo, 2 ranks on 1 GPU``."""
    import torch

    from dcpcheck.ranks.placement import Placement

    gpus = torch.cuda.device_count()
    return Placement("cuda" if gpus else "cpu", world_size, gpus).describe()


def write_session(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "conftest.py").write_text(INNER_CONFTEST)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def start_inner_pytest(tmp_path: Path, args: list[str], *, own_group: bool = False, **env) -> subprocess.Popen:
    """``own_group``: in a process group of its own, as a shell's foreground
    job is, so that ``os.killpg`` signals it as a terminal's Ctrl-C would; and
    with SIGINT's default action, which a shell's foreground job has (a
    background job, as CI may run this suite, inherits SIGINT ignored)."""
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *args],
        cwd=tmp_path,
        env=inner_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        process_group=0 if own_group else None,
        preexec_fn=_default_sigint if own_group else None,
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def warm_server() -> ZygoteServer:
    """This process's warm interpreter, started at the first call with
    :func:`inner_env` (the environment that runs share: each run sets its own in full)."""
    global _warm_server
    if _warm_server is None or not _warm_server.alive:
        if _warm_server is not None:
            _warm_server.stop()
        _warm_server = ZygoteServer(
            inner_env(), WARM_SERVER, WARM_SERVER_STARTUP_TIMEOUT_S, WARM_SERVER_ANSWER_TIMEOUT_S
        )
        atexit.register(_warm_server.stop)
    return _warm_server


def run_python_module(tmp_path: Path, module: str, args: list[str], *, env: dict, timeout: float):
    """(exit code, output: stdout and stderr) of ``python -m module args`` in
    ``tmp_path`` with ``env``, forked from this process's warm interpreter
    (:func:`warm_server`); exit code None when it did not end within
    ``timeout`` s (its process group is killed: a hung inner session must not outlive its test)."""
    output = tmp_path / f".warm-python-{os.getpid()}.out"
    run = warm_server().run_module(module, args, cwd=str(tmp_path), environ=env, log=str(output))
    try:
        code = run.wait(timeout)
    except subprocess.TimeoutExpired:
        _kill_group(run.pid)
        run.wait(KILLED_RUN_WAIT_S)
        code = None
    text = output.read_text(errors="replace")
    output.unlink()
    return code, text


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # not in its own group, or gone
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_inner_pytest(tmp_path: Path, args: list[str], timeout: float = 240, **env) -> tuple[int, str]:
    code, output = run_python_module(
        tmp_path, "pytest", ["-p", "no:cacheprovider", "-q", "-rs", *args], env=inner_env(**env), timeout=timeout
    )
    if code is None:
        raise AssertionError(f"inner pytest did not end within {timeout:g} s:\n{output}")
    return code, output


def run_sessions_in_one_interpreter(
    tmp_path: Path, cases: dict[str, tuple[list[str], dict[str, str]]], timeout: float = 240
) -> dict[str, tuple[int, str]]:
    """name -> (exit code, output) of one inner session per case (its pytest
    arguments, its environment), all run in one interpreter from ``tmp_path``
    (written with :func:`write_session`). For sessions whose checks need no
    process of their own: each costs a collection, not an interpreter start."""
    (tmp_path / "cases.json").write_text(json.dumps([{"args": args, "env": env} for args, env in cases.values()]))
    env = inner_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])  # implementations by module name
    env[session_probe.RESULTS_ENV] = str(tmp_path / "results.json")
    code, output = run_python_module(
        tmp_path, "tests.selftest.support.session_probe", ["cases.json"], env=env, timeout=timeout
    )
    assert code == 0, output
    results = json.loads((tmp_path / "results.json").read_text())
    return {name: (result["code"], result["output"]) for name, result in zip(cases, results)}
