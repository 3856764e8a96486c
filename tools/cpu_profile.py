"""Where the CPU time of a pytest run goes: by kind of work, by process, and
per Triton kernel run under the interpreter.

    # sample pytest and every process it starts, then report (exit status: py-spy's)
    tools/cpu_profile.py run --raw build/cpu_profile.txt --markdown reports/cpu_profile.md -- \\
        --world-sizes 1,2,4,8 -n 2 --dist loadgroup
    tools/cpu_profile.py report --raw build/cpu_profile.txt

``run`` samples with py-spy (``pip install -e ".[profile]"``), following every
subprocess and fork: xdist workers, pool zygotes and their ranks, inner
sessions of the self-tests. The samples are py-spy's raw format (one
collapsed stack and its count a line). ``report`` sorts them into
:data:`KINDS` (the first that matches a stack wins), by process, and per
kernel; shares are of all samples, so they add up to 100 %. A sample is a
thread seen running, not CPU time measured: shares compare, seconds do not.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# What a frame's function is, from py-spy's "function (path:line)".
NESTED_JIT_CALL = "InterpretedFunction.__call__"  # a @triton.jit function called from a kernel
# One launch: its body runs once per program instance, or once for all of
# them where dcpcheck/triton_interpreter/vectorised_launches.py vectorises it.
KERNEL_LAUNCHES = ("GridExecutor.__call__", "_vectorised_call")
# As shipped, the interpreter swaps triton.language for its own at each call of
# either; dcpcheck's shortcut (dcpcheck/triton_interpreter/language_shortcut.py) takes its place
# and patches once per process: at later calls its frame alone, an O(1) check.
PATCH_LANG = ("_patch_lang", "keep_lang_patched")
SHORTCUT_FILE = "dcpcheck/triton_interpreter/language_shortcut.py"
CASE_FRAMES = ("run_rank_case", "pytest_runtest_call", "pytest_runtest_setup")
IMPORT_FRAME = "_find_and_load"
PROCESS_FRAME = re.compile(r'process \d+:"(.*?)"(?=;|$)')  # py-spy --subprocesses: one per process, outermost first

NESTED_PATCHING = "Triton interpreter: triton.language patched again at a nested @triton.jit call"

# (kind, test on a stack's frames): the first that matches names a sample.
KINDS = (
    (NESTED_PATCHING, lambda frames: _calls(frames, NESTED_JIT_CALL, PATCH_LANG)),
    (
        "Triton interpreter: per launch (triton.language patched, arguments copied)",
        lambda frames: any(launch in frames for launch in KERNEL_LAUNCHES) and _kernel_of(frames) is None,
    ),
    ("Triton interpreter: kernel bodies", lambda frames: _kernel_of(frames) is not None),
    (
        "imports at a process's start (interpreter, torch, plugins)",
        lambda frames: IMPORT_FRAME in frames and not any(f in frames for f in CASE_FRAMES),
    ),
    ("imports within a case", lambda frames: IMPORT_FRAME in frames),
    ("float64 oracle", lambda frames: _in_file(frames, "dcpcheck/oracle/")),
    ("comparisons (dcpcheck.compare)", lambda frames: _in_file(frames, "dcpcheck/compare.py")),
    ("scenario inputs (dcpcheck.scenarios)", lambda frames: _in_file(frames, "dcpcheck/scenarios/")),
    ("torch.distributed", lambda frames: _in_file(frames, "torch/distributed/")),
    ("other", lambda frames: True),
)

# Process kinds by their command line, the first that matches.
PROCESS_KINDS = (
    ("pool zygote and ranks", "dcpcheck.ranks.worker"),
    # The self-tests' warm interpreter (tests/selftest/support/inner.py): its inner sessions show its command line.
    ("inner sessions of self-tests (warm interpreter)", "--freeze-imports"),
    ("pool zygote and ranks", "dcpcheck.ranks.zygote_server"),  # zygotes forked from it show its command line
    ("xdist workers", "exec(eval(sys.stdin.readline()))"),  # execnet's bootstrap
    ("inner sessions of self-tests (session probe)", "tests.selftest.support.session_probe"),
    ("torchrun", "torchrun"),
    ("pytest (the session, inner sessions)", "pytest"),
    ("other", ""),
)


@dataclass
class Frames:
    """One stack's functions (outermost first) and their files."""

    names: list[str]
    files: list[str]
    process: str  # the innermost process's command line

    def __contains__(self, name: str) -> bool:
        return name in self.names


def _calls(frames: Frames, caller: str, callees: tuple[str, ...]) -> bool:
    """``caller`` calls one of ``callees`` directly somewhere in the stack."""
    return any(a == caller and b in callees for a, b in zip(frames.names, frames.names[1:]))


def _in_file(frames: Frames, part: str) -> bool:
    return any(part in path for path in frames.files)


def _is_library(path: str) -> bool:
    """Triton's own code, dcpcheck's shortcut through it, or the standard library's
    (py-spy shows a stdlib module by its file name alone)."""
    return (
        "triton/" in path or SHORTCUT_FILE in path or ("/" not in path and Path(path).stem in sys.stdlib_module_names)
    )


def _kernel_of(frames: Frames) -> str | None:
    """The kernel a launch runs: the function its GridExecutor calls, when that is not library code."""
    for index, name in enumerate(frames.names[:-1]):
        if name in KERNEL_LAUNCHES and not _is_library(frames.files[index + 1]):
            return f"{frames.names[index + 1]} ({frames.files[index + 1]})"
    return None


def parse_line(line: str) -> tuple[Frames, int] | None:
    """One raw line -> (its frames, its sample count); None for a line that is not a stack."""
    stack, _, count = line.rstrip("\n").rpartition(" ")
    if not stack or not count.isdigit():
        return None
    processes = PROCESS_FRAME.findall(stack)  # outermost first; a command line may hold a ";"
    names, files = [], []
    for frame in PROCESS_FRAME.sub("", stack).split(";"):
        if not frame:
            continue
        name, _, where = frame.partition(" (")
        names.append(name)
        files.append(where.rpartition(":")[0] if ":" in where else where.rstrip(")"))
    return Frames(names, files, processes[-1] if processes else ""), int(count)


def kind_of(frames: Frames) -> str:
    return next(kind for kind, matches in KINDS if matches(frames))


def process_kind_of(command: str) -> str:
    return next(kind for kind, part in PROCESS_KINDS if part in command)


@dataclass
class Profile:
    total: int = 0
    kinds: Counter = field(default_factory=Counter)
    processes: Counter = field(default_factory=Counter)
    kernels: Counter = field(default_factory=Counter)  # kernel -> samples in its launches' bodies
    nested_patching: Counter = field(default_factory=Counter)  # kernel -> of those, re-patching

    @classmethod
    def read(cls, lines) -> Profile:
        profile = cls()
        for line in lines:
            parsed = parse_line(line)
            if parsed is None:
                continue
            frames, count = parsed
            kind = kind_of(frames)
            profile.total += count
            profile.kinds[kind] += count
            profile.processes[process_kind_of(frames.process)] += count
            kernel = _kernel_of(frames)
            if kernel is not None:
                profile.kernels[kernel] += count
                if kind == NESTED_PATCHING:
                    profile.nested_patching[kernel] += count
        return profile

    def markdown(self, title: str) -> str:
        def share(count: int) -> str:
            return f"{100 * count / self.total:.1f} %"

        lines = [f"# {title}", "", f"{self.total} samples, all processes.", ""]
        lines += ["| kind of work | share |", "|---|---:|"]
        lines += [f"| {kind} | {share(count)} |" for kind, count in self.kinds.most_common()]
        lines += ["", "| process | share |", "|---|---:|"]
        lines += [f"| {kind} | {share(count)} |" for kind, count in self.processes.most_common()]
        lines += ["", "| kernel (interpreted) | share | of it, re-patching at nested calls |", "|---|---:|---:|"]
        lines += [
            f"| `{kernel}` | {share(count)} | {share(self.nested_patching[kernel])} |"
            for kernel, count in self.kernels.most_common()
        ]
        return "\n".join(lines) + "\n"


def record(raw: Path, rate: int, pytest_args: list[str]) -> int:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        raise SystemExit('cpu_profile: py-spy is not installed; accepted: pip install -e ".[profile]"')
    raw.parent.mkdir(parents=True, exist_ok=True)
    command = [py_spy, "record", "--subprocesses", "--nonblocking", "--rate", str(rate), "--format", "raw"]
    command += ["--output", str(raw), "--", sys.executable, "-m", "pytest", *pytest_args]
    return subprocess.run(command).returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "report"):
        command = sub.add_parser(name)
        command.add_argument("--raw", type=Path, required=True, help="py-spy's raw samples (run: written)")
        command.add_argument("--markdown", help="write the report here too")
    sub.choices["run"].add_argument("--rate", type=int, default=20, help="samples a second per process")
    sub.choices["run"].add_argument("pytest_args", nargs=argparse.REMAINDER, help="-- then pytest's arguments")
    args = parser.parse_args(argv)
    status = 0
    title = "Where the CPU time of a pytest run goes"
    if args.command == "run":
        pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
        status = record(args.raw, args.rate, pytest_args)
        title += ": `pytest " + " ".join(pytest_args) + "`"
    if not args.raw.is_file():
        raise SystemExit(f"cpu_profile: no samples at {args.raw}; accepted: a file written by `run`")
    with open(args.raw) as raw:
        report = Profile.read(raw).markdown(title)
    print(report, end="")
    if args.markdown:
        Path(args.markdown).write_text(report)
    return status


if __name__ == "__main__":
    sys.exit(main())
