"""No process outlives what started it: the kernel's parent-death signal,
child subreapers, and killing a whole process tree without a gap for a fork.

* ``die_with_parent``: ``PR_SET_PDEATHSIG``, so the kernel signals a process
  when its parent dies: it needs no thread of the process to run, so it also
  ends a rank spinning with the GIL held.
* ``become_subreaper``: ``PR_SET_CHILD_SUBREAPER``, so a descendant that
  detaches (a double fork, a new session) is re-parented to this process,
  not to init, and stays in its tree.
* ``kill_tree``: stops every process of a tree (a stopped process cannot
  fork), until no new one appears, then kills them all.
"""

from __future__ import annotations

import ctypes
import os
import signal

from dcpcheck.ranks.procstate import process_state_letter, stat_fields

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
# Rounds of "stop what is new" before the kill: each round catches the
# children forked just before their parent was stopped.
MAX_STOP_ROUNDS = 50

_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> None:
    if _libc.prctl(option, value, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl({option}, {value}): {os.strerror(errno)}")


def die_with_parent(sig: signal.Signals, parent_pid: int) -> None:
    """Have the kernel send ``sig`` when the parent dies; send it now if it
    already has (before the prctl: no signal will come), so that a handler of
    ``sig`` (the zygote's removes the pool's directory) runs either way."""
    _prctl(PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def become_subreaper() -> None:
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def _process_table() -> list[tuple[int, str, int]]:
    """(pid, state letter, parent pid) of every process in /proc."""
    table = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = stat_fields(int(entry.name))
        if fields:
            table.append((int(entry.name), fields[0], int(fields[1])))
    return table


def descendants(root: int) -> set[int]:
    """The descendants of ``root`` (not ``root`` itself), zombies included:
    what ``/proc`` shows as a zombie may still hold children, a process whose
    main thread ended while its other threads run (as a rank killed by a
    signal is for a moment), or one whose children were read before they were
    re-parented."""
    children: dict[int, list[int]] = {}
    for pid, _, ppid in _process_table():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop_then_kill(find) -> set[int]:
    """SIGSTOP what ``find()`` returns until it returns nothing new (a stopped
    process cannot fork), then SIGKILL all of it; reap this process's children among it."""
    stopped: set[int] = set()
    for _ in range(MAX_STOP_ROUNDS):
        new = find() - stopped
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        stopped |= new
    for pid in stopped:
        _signal(pid, signal.SIGKILL)
    for pid in stopped:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass  # not this process's child: its own parent reaps it
    return stopped


def kill_tree(root: int, *, include_root: bool) -> set[int]:
    """SIGKILL every descendant of ``root`` (and ``root`` when asked)."""
    return _stop_then_kill(
        lambda: descendants(root) | ({root} if include_root and process_state_letter(root) else set())
    )


def reap_exited_children(keep: set[int] = frozenset()) -> None:
    """Reap this process's exited children (a subreaper inherits detached
    ones, which nobody else will wait for), except those in ``keep``."""
    me = os.getpid()
    for pid, state, ppid in _process_table():
        if state == "Z" and ppid == me and pid not in keep:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def _has_children() -> bool:
    """Whether this process has a child, exited or not: a descendant hangs
    below one, and one re-parented to this subreaper becomes one. Reads this
    process's few ``children`` lists, not every process's stat (as the
    process table does: milliseconds, paid by every rank after every case)."""
    try:
        for task in os.scandir("/proc/self/task"):
            with open(f"{task.path}/children") as fh:
                if fh.read().strip():
                    return True
    except OSError:
        return True  # a kernel without these lists: the process table tells
    return False


def end_case_processes(before: set[int]) -> None:
    """Kill what the case started: every descendant of this process that
    was not there before it (``descendants(os.getpid())`` at its start)."""
    if not _has_children():
        return  # nothing below this process: nothing started, nothing to reap
    _stop_then_kill(lambda: descendants(os.getpid()) - before)
    reap_exited_children(keep=before)
