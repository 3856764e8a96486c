"""In-process ranks for ``torchrun --nproc-per-node N -m pytest``.

Every rank runs the whole pytest session; each multi-rank test runs its rank
function in a *case thread* of this process, on the launcher's group, while
the main thread keeps the time. The ranks exchange what happened through the
launcher's store (:class:`~dcpcheck.ranks.outcome_board.OutcomeBoard`), keyed
by the test's node id, never through a collective: a rank that is stuck, that
left the case early or whose process is gone cannot pair its report with a
peer's pending collective, nor with another test's report.

* A case thread still running at the case timeout (or ``PEER_GRACE_S`` after
  a peer failed) is *stuck*: its rank reports its Python stack, abandons it
  and puts back what it changed of the environment and torch's settings; the
  next case gets a fresh DCP group.
* The implementation's answers before launch are asked on rank 0 and taken
  from the store by every rank, so all ranks skip or run a case alike.
* Processes a case started are killed when it ends (this process is their
  subreaper, so a detached one is found too); the kernel kills the rank when
  torchrun's agent dies.
* A rank that sends no report at all (its process ended, is stopped, or
  spins holding the GIL) is named with what its process is doing, and the
  session stops: these ranks can run no further case together.
* Before the first case the ranks compare what decides a case (the stage
  variable, the options, the collected tests): ranks that differ would pair
  one test's collectives with another's, or wait on a case a peer skips.
* Start-up (``init_process_group``) is bounded by ``--dcp-startup-timeout``,
  as a spawned pool's is.
* A rank with a thread still in torch's C++ code at exit (an abandoned case
  thread in a collective, a start-up that never returned) leaves without
  interpreter finalization: that thread, woken by a peer's exit, would abort
  the process (std::terminate) after a correct report.
"""

from __future__ import annotations

import atexit
import faulthandler
import itertools
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from dcpcheck.group import DcpGroup
from dcpcheck.impls.protocol import KnownFailure
from dcpcheck.impls.registry import load_implementation
from dcpcheck.ranks.case_state import CaseState
from dcpcheck.ranks.cuda_driver import block_while_waiting
from dcpcheck.ranks.launcher import COLLECTIVE_TIMEOUT_GRACE_S, PEER_GRACE_S, Case, CaseResult, LaunchError
from dcpcheck.ranks.outcome_board import NO_DECISION, POLL_S, OutcomeBoard, RankReport
from dcpcheck.ranks.placement import Placement
from dcpcheck.ranks.procstate import describe_process
from dcpcheck.ranks.rankfn import RankContext, RankOutcome, bounded, describe_exception, run_rank_case
from dcpcheck.ranks.reaper import become_subreaper, descendants, die_with_parent, end_case_processes

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# After the case timeout, how long the ranks wait for each other's reports: a
# rank that sent none by then is silent.
REPORT_GRACE_S = 10.0
# A rank whose main thread cannot run (a case thread holding the GIL) dumps
# its stacks and exits this long after the case timeout (faulthandler's C
# watchdog needs no GIL), which ends the torchrun job.
WEDGED_EXIT_S = 60.0
# On CUDA a stuck case gets its DCP group's communicator aborted (see
# _abandon); 0 keeps NCCL's watchdog from racing that abort or taking the
# whole torchrun job down on the same timeout.
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
CASE_THREAD = "dcpcheck-case"
INIT_THREAD = "dcpcheck-init"


def launched_by_torchrun(environ=os.environ) -> bool:
    return all(name in environ for name in LAUNCHER_VARS)


def launcher_world_size(environ=os.environ) -> int:
    return int(environ["WORLD_SIZE"])


def launcher_rank(environ=os.environ) -> int:
    return int(environ["RANK"])


class _JobStopping(BaseException):
    """SIGTERM during a case: torchrun is ending the job (typically because a
    peer's process ended)."""


class _CaseThread(threading.Thread):
    def __init__(self, fn, ctx: RankContext):
        super().__init__(name=CASE_THREAD, daemon=True)  # an abandoned one must not hold up the exit
        self.fn, self.ctx = fn, ctx
        self.outcome: RankOutcome | None = None

    def run(self) -> None:
        if self.ctx.device.type == "cuda":
            torch.cuda.set_device(self.ctx.device)  # the current device is per thread
        self.outcome = run_rank_case(self.fn, self.ctx)


def _thread_stack(thread: threading.Thread) -> str:
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return "(no stack: the case thread ended)"
    return f'Thread "{thread.name}" (the case):\n' + "".join(traceback.format_stack(frame)).rstrip()


class InProcessRanks:
    """This process is one rank of the launcher's world."""

    def __init__(self, placement: Placement, *, impl_spec: str, case_timeout: float, startup_timeout: float):
        self.impl_spec = impl_spec
        self.rank = launcher_rank()
        self.world_size = launcher_world_size()
        die_with_parent(signal.SIGKILL, os.getppid())
        become_subreaper()
        self.backend = placement.backend
        self.case_timeout = case_timeout
        self.startup_timeout = startup_timeout
        self.device = placement.device(int(os.environ["LOCAL_RANK"]))
        if self.device.type == "cuda":
            block_while_waiting(self.device.index)
            torch.cuda.set_device(self.device)
        if self.backend == "nccl":
            os.environ.setdefault(*NCCL_ERROR_HANDLING)
        if not dist.is_initialized():
            self._init_default_group()
        self.board = OutcomeBoard(dist.distributed_c10d._get_default_store(), self.rank, self.world_size)
        self.board.announce()
        self.group: DcpGroup | None = None
        # Groups a stuck case thread may still be waiting in: kept referenced,
        # so that no destructor waits for that thread.
        self.abandoned: list[DcpGroup] = []
        self.calls_per_test: dict[str, itertools.count] = {}
        self.decisions_per_test: dict[str, itertools.count] = {}
        # torchrun's SIGTERM outside a case thread's run (between cases, or
        # while a case is being reported) is remembered, never fatal: the
        # report must reach rank 0's JUnit file, and the next case stops the
        # session instead of waiting on peers that are gone.
        self.sigterm_seen = False
        signal.signal(signal.SIGTERM, self._remember_sigterm)

    def _init_default_group(self) -> None:
        """``init_process_group``, waited on for ``startup_timeout`` at most
        (in a thread: an implementation may have replaced it, and a peer that
        never calls it leaves it waiting for its own, longer timeout)."""
        raised: list[BaseException] = []

        def init() -> None:
            try:
                dist.init_process_group(
                    self.backend,
                    timeout=timedelta(seconds=self.case_timeout + COLLECTIVE_TIMEOUT_GRACE_S),
                    **({"device_id": self.device} if self.backend == "nccl" else {}),
                )
            except BaseException as exc:  # noqa: BLE001 - raised again as this rank's start-up failure
                raised.append(exc)

        thread = threading.Thread(target=init, name=INIT_THREAD, daemon=True)
        thread.start()
        thread.join(self.startup_timeout)
        waited = (
            f"torch.distributed.init_process_group(backend={self.backend!r}) on rank {self.rank}, "
            f"joining the {self.world_size} ranks at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']},"
        )
        if thread.is_alive():
            raise LaunchError(
                f"{waited} did not return within {self.startup_timeout:g} s (--dcp-startup-timeout); "
                f"it waits in {_innermost_frame(thread)}"
            )
        if raised:
            raise LaunchError(f"{waited} raised {' '.join(describe_exception(raised[0]).split())}")

    def disagreement(self, settings: dict) -> str | None:
        """Post this rank's ``settings`` (what decides a case: plain data) and
        compare every rank's: -> the usage error naming the ranks that differ
        and their values, else None. Raises :class:`LaunchError` when a rank
        posted none within ``startup_timeout``."""
        store = self.board.store
        store.set(f"settings/{self.rank}", json.dumps(settings))
        keys = [f"settings/{rank}" for rank in range(self.world_size)]
        deadline = time.perf_counter() + self.startup_timeout
        while not store.check(keys):
            if time.perf_counter() > deadline:
                missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
                states = "; ".join(
                    f"rank {rank}'s process {self.board.process_state(rank, describe_process)}" for rank in missing
                )
                raise LaunchError(
                    f"rank(s) {missing} posted no session settings within {self.startup_timeout:g} s "
                    f"(--dcp-startup-timeout) after start-up; {states}"
                )
            time.sleep(POLL_S)
        return describe_disagreement({rank: json.loads(store.get(key)) for rank, key in enumerate(keys)})

    def decide_before_launch(self, case: Case, ask):
        """Rank 0 asks; every rank takes its answers from the store, so all
        ranks skip, mark or run the case alike (an answer that differed
        between ranks, or raised on one, had one rank skip ahead of its peers'
        collectives)."""
        key = f"{case.nodeid}#{next(self.decisions_per_test.setdefault(case.nodeid, itertools.count()))}"
        timeout = case.timeout
        # Rank 0 asks two questions, each bounded by the timeout.
        posted = self.board.decision(
            key, lambda: _answers_as_json(ask()), deadline=time.perf_counter() + 2 * timeout + REPORT_GRACE_S
        )
        if posted is NO_DECISION:
            raise LaunchError(
                f"rank 0 posted no answers before launch within {2 * timeout + REPORT_GRACE_S:g} s; its process "
                + self.board.process_state(0, describe_process)
            )
        return _answers_from_json(posted)

    def _new_dcp_group(self) -> DcpGroup:
        # Longer than the case timeout: a stuck case is ended (and its stacks
        # read) by the main thread, not by its collective raising first.
        timeout = timedelta(seconds=self.case_timeout + COLLECTIVE_TIMEOUT_GRACE_S)
        device_group = dist.new_group(backend=self.backend, timeout=timeout)
        # Distinct from the device group on every backend, as vLLM's GroupCoordinator keeps them.
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        return DcpGroup(self.rank, self.world_size, self.device, device_group, cpu_group)

    def run(self, fn, case: Case) -> CaseResult:
        assert case.world_size == self.world_size, "the plugin skips other world sizes before launch"
        timeout = case.timeout
        # The n-th case of this test: every rank agrees on it without talking,
        # and no report can be taken for another test's.
        key = f"{case.nodeid}#{next(self.calls_per_test.setdefault(case.nodeid, itertools.count()))}"
        started = time.perf_counter()
        before = descendants(os.getpid())
        faulthandler.dump_traceback_later(timeout + WEDGED_EXIT_S, exit=True, file=sys.stderr)
        signal.signal(signal.SIGTERM, _raise_job_stopping)
        real_exit = os._exit
        os._exit = self._reporting_exit(key, real_exit)
        stopping = None
        try:
            if self.sigterm_seen:
                raise _JobStopping()
            if self.group is None:
                self.group = self._new_dcp_group()
            self.group.collective_calls = 0
            ctx = RankContext(self.group, self.device, load_implementation(self.impl_spec), case)
            thread = _CaseThread(fn, ctx)
            state = CaseState()  # what an abandoned case thread changed is put back from here
            thread.start()
            report = self._await(thread, key, started, timeout, state)
            end_case_processes(before)  # before reporting: once a peer has the verdict, they are gone
            self.board.post(key, report)
            reports = self.board.verdict(key, deadline=started + timeout + REPORT_GRACE_S)
        except _JobStopping:
            self.sigterm_seen = True
            reports = self.board.read(key)
        finally:
            signal.signal(signal.SIGTERM, self._remember_sigterm)
            os._exit = real_exit
            faulthandler.cancel_dump_traceback_later()
            end_case_processes(before)  # also when the case was cut short
        if self.sigterm_seen:
            stopping = "torchrun is ending the job (SIGTERM), typically because a peer's process ended"
        result = self._result(reports, timeout, stopping)
        result.seconds = time.perf_counter() - started
        if not result.ok:
            # A failed case may have left collectives unmatched, or a thread in
            # one: the next case starts on a fresh group.
            self.abandoned.append(self.group)
            self.group = None
        return result

    def _await(self, thread: _CaseThread, key: str, started: float, timeout: float, state: CaseState) -> RankReport:
        """This rank's report: its outcome, or its stack when its case thread
        is still running at the timeout or ``PEER_GRACE_S`` after a peer failed
        (it is abandoned: what it changed of the process's state is put back,
        as a finished case's is, since it never finishes)."""
        deadline = started + timeout
        peer_failed = None
        while thread.is_alive():
            now = time.perf_counter()
            limit = deadline if peer_failed is None else min(deadline, peer_failed + PEER_GRACE_S)
            if now >= limit:
                stack = _thread_stack(thread)
                self._abandon(thread)
                put_back = state.put_back()
                if put_back:
                    stack += f"\n(the case is abandoned; its changes of {'; '.join(put_back)} were put back)"
                return RankReport(self.rank, stack=stack, timed_out=peer_failed is None)
            thread.join(min(0.1, limit - now))
            if peer_failed is None and self.board.any_failure(key):
                peer_failed = time.perf_counter()
        return RankReport(self.rank, outcome=thread.outcome)

    def _remember_sigterm(self, signum, frame) -> None:
        self.sigterm_seen = True

    def _abandon(self, thread: _CaseThread) -> None:
        """Under NCCL, abort the stuck group's communicator so that the stuck
        kernel exits: NCCL's own watchdog was seen blocked for as long as the
        case thread waited on the kernel (in ``.item()``)."""
        if self.backend == "nccl":
            self.group.device_group.abort()
            thread.join(PEER_GRACE_S)

    def _reporting_exit(self, key: str, real_exit):
        def exit_reporting_it(code: int = 0):
            try:
                self.board.post(key, RankReport(self.rank, left=f"called os._exit({code}) during the case"))
            finally:
                real_exit(code)

        return exit_reporting_it

    def _result(self, reports: dict, timeout: float, stopping: str | None) -> CaseResult:
        result = CaseResult(self.world_size, stop_session=stopping)
        for rank in range(self.world_size):
            report = reports.get(rank)
            if report is None:
                result.silent[rank] = (
                    f"sent no report within {timeout + REPORT_GRACE_S:g} s; its process "
                    + self.board.process_state(rank, describe_process)
                )
            elif report.left:
                result.dead[rank] = report.left
            elif report.stack is not None:
                result.stuck[rank] = bounded(report.stack)
                result.timed_out = result.timed_out or report.timed_out
            else:
                result.outcomes[rank] = report.outcome
        if result.silent and result.stop_session is None:
            result.stop_session = f"rank(s) {sorted(result.silent)} sent no report: no later case can run on them"
        if result.dead and result.stop_session is None:
            result.stop_session = f"rank(s) {sorted(result.dead)} ended their process: torchrun ends the job"
        return result

    def stop(self) -> None:
        # A thread abandoned in a collective would make the group's
        # destruction wait for that collective's own timeout.
        if dist.is_initialized() and not self.abandoned:
            dist.destroy_process_group()


def _raise_job_stopping(signum, frame):
    raise _JobStopping()


def _innermost_frame(thread: threading.Thread) -> str:
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return "(no frame: it has just returned)"
    return f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})"


def _answers_as_json(answers) -> str:
    """Rank 0's answers before launch, as the store carries them: strings and
    None, a known defect as its strings; never a pickled class (the
    implementation's own KnownFailure subclass need not unpickle on a peer)."""
    reason, defect, failure = answers
    if isinstance(defect, KnownFailure):
        defect = [defect.reason, defect.shows, list(defect.cures)]
    return json.dumps([reason, defect, failure])


def _answers_from_json(posted: str) -> tuple:
    reason, defect, failure = json.loads(posted)
    if isinstance(defect, list):
        defect = KnownFailure(defect[0], defect[1], tuple(defect[2]))
    return reason, defect, failure


def _shown(value) -> str:
    """A setting's value in the disagreement message; a list is the collected node ids."""
    if value is None:
        return "unset"
    if isinstance(value, list):
        return f"{len(value)} collected"
    return repr(value)


def _collected_difference(ids: list, common: set, reordered: bool) -> str:
    if reordered:
        return " (in another order)"
    extra = [nodeid for nodeid in ids if nodeid not in common]
    if not extra:
        return ""
    more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
    return f" ({extra[0]}{more} not on every rank)"


def describe_disagreement(by_rank: dict[int, dict]) -> str | None:
    """The usage error of ranks whose settings differ (rank -> setting ->
    value), naming each differing setting's ranks and values; else None."""
    differing = []
    for name in by_rank[0]:
        ranks_by_value: dict[str, list[int]] = {}
        for rank, settings in sorted(by_rank.items()):
            ranks_by_value.setdefault(json.dumps(settings.get(name)), []).append(rank)
        if len(ranks_by_value) < 2:
            continue
        values = [json.loads(value) for value in ranks_by_value]
        sets = [set(value) for value in values] if isinstance(values[0], list) else []
        common, reordered = (set.intersection(*sets), all(each == sets[0] for each in sets)) if sets else (set(), False)
        groups = []
        for value, ranks in zip(values, ranks_by_value.values()):
            shown = _shown(value) + (_collected_difference(value, common, reordered) if sets else "")
            groups.append(f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}: {shown}")
        differing.append(f"{name}: {'; '.join(groups)}")
    if not differing:
        return None
    return (
        f"torchrun: the ranks differ in what decides a case ({' | '.join(differing)}); "
        "launch every rank with the same environment, options and tests"
    )


def leave_at_exit_if_stranded(exit_status: Callable[[], int]) -> None:
    """At exit, should a case or start-up thread of this process still be
    running, run the other exit handlers, then end the process with
    ``exit_status()`` without finalizing the interpreter: such a thread,
    waiting in torch's C++ code (a collective, a store), wakes when a peer's
    process ends, and doing so while the interpreter finalizes aborts this
    one (``terminate called without an active exception``)."""
    atexit.register(_leave_if_stranded, exit_status)


def _leave_if_stranded(exit_status: Callable[[], int]) -> None:
    if not any(thread.name in (CASE_THREAD, INIT_THREAD) for thread in threading.enumerate()):
        return
    atexit.unregister(_leave_if_stranded)
    atexit._run_exitfuncs()  # the others (coverage's, logging's) still run
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(exit_status()))
