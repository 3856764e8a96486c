"""A deadline on loading the implementation that holds even when the loading
process never runs Python again: an import spinning in C with the GIL held
(a regular expression backtracking without bound, a C loop called through
ctypes) stops every thread of its interpreter, the registry's deadline
thread included. The watchdog is a process of its own: past its deadline it
writes the usage error, has the stuck process write its Python stacks
(faulthandler's C handler, which needs no GIL) and kills it."""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
from contextlib import contextmanager

STACK_SIGNAL = signal.SIGUSR1  # as the ranks' stacks are read (dcpcheck/ranks/worker.py)
STACKS_WRITTEN_S = 1.0  # what faulthandler may take to write the stacks before the kill
# The watchdog's stdin is a pipe the loading process holds open: its end (the
# load returned, or the process died) ends the watchdog at once.
WATCHDOG = """
import os, select, signal, sys
parent, seconds, message, stack_signal, stacks_s = sys.argv[1:]
if not select.select([0], [], [], float(seconds))[0]:
    os.write(2, message.encode())
    os.kill(int(parent), int(stack_signal))
    select.select([0], [], [], float(stacks_s))
    os.kill(int(parent), signal.SIGKILL)
"""


@contextmanager
def killed_past(seconds: float, message: str):
    """This process, killed with ``message`` and its Python stacks on stderr
    unless the block ends within ``seconds``."""
    faulthandler.register(STACK_SIGNAL, file=sys.__stderr__, all_threads=True, chain=False)
    watchdog = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", WATCHDOG, str(os.getpid()), repr(seconds), message]
        + [str(int(STACK_SIGNAL)), repr(STACKS_WRITTEN_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
    )
    try:
        yield
    finally:
        watchdog.stdin.close()
        watchdog.wait()
        faulthandler.unregister(STACK_SIGNAL)
