"""Run an inner pytest session in a subprocess, for checks of the harness
itself (usage errors, skips, what a session leaves behind)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.selftest.support import session_probe
from tests.selftest.support.warm_python import warm_python

REPO_ROOT = Path(__file__).resolve().parents[3]
INNER_CONFTEST = 'pytest_plugins = ["dcpcheck.plugin"]\n'


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


def run_python_module(tmp_path: Path, module: str, args: list[str], *, env: dict, timeout: float):
    """(exit code, output: stdout and stderr) of ``python -m module args`` in
    ``tmp_path`` with ``env``, forked from a warm interpreter
    (:mod:`tests.selftest.support.warm_python`); exit code None when it did not end
    within ``timeout`` s (it is killed: a hung inner session must not outlive its test)."""
    return warm_python(inner_env()).run_module(module, args, cwd=tmp_path, env=env, timeout=timeout)


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
