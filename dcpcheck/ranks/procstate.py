"""What a process is doing, read from ``/proc``, or how it ended, for failure
messages about a process that does not answer."""

from __future__ import annotations

import os
import signal

# /proc/<pid>/stat state letters, as a failure message says them.
STATES = {
    "R": "is running but does not answer (busy, e.g. a loop holding the GIL)",
    "S": "is sleeping and does not answer",
    "D": "is in an uninterruptible wait (I/O or a driver call)",
    "T": "is stopped (SIGSTOP or SIGTSTP)",
    "t": "is stopped by a debugger",
    "Z": "has exited (not yet reaped)",
    "X": "has exited",
}


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts: signal 0 is refused it, not absent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state letter
    first, then the parent pid), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses


def process_state_letter(pid: int) -> str | None:
    """The state letter of ``pid``, or None when there is no such process."""
    fields = stat_fields(pid)
    return fields[0] if fields else None


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid``, or None when there is no such process."""
    fields = stat_fields(pid)
    return int(fields[1]) if fields else None


def describe_process(pid: int) -> str:
    letter = process_state_letter(pid)
    if letter is None:
        return f"(pid {pid}) has ended"
    return f"(pid {pid}) " + STATES.get(letter, f"is in state {letter!r}")


def describe_exit(returncode: int) -> str:
    """A ``Popen.returncode`` in words: negative is the signal that killed the process."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {name} ({-returncode})"
    return f"exited with code {returncode}"
