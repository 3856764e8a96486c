"""In-process ranks for ``torchrun --nproc-per-node N -m pytest``.

Every rank runs the whole pytest session; each multi-rank test runs its rank
function in this process on the launcher's group. Outcomes are exchanged on a
group of their own that no test touches, so a rank that failed before a
collective cannot pair its report with a peer's pending collective: the peer's
collective times out (the group timeout is the case timeout), then both report.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from dcpcheck.impls.registry import load_implementation
from dcpcheck.ranks.group import DcpGroup
from dcpcheck.ranks.launcher import CaseResult
from dcpcheck.ranks.rankfn import RankContext, RankOutcome, run_rank_case

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# Extra seconds, past the case timeout, before a rank stuck outside any
# collective dumps its stack and exits (which ends the torchrun job).
WATCHDOG_GRACE_S = 30.0
# On CUDA a case that overruns its timeout gets its DCP group's communicator
# aborted by a timer (see _run_case); 0 keeps NCCL's watchdog from racing
# that abort or taking the whole torchrun job down on the same timeout.
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")


def launched_by_torchrun(environ=os.environ) -> bool:
    return all(name in environ for name in LAUNCHER_VARS)


def launcher_world_size(environ=os.environ) -> int:
    return int(environ["WORLD_SIZE"])


def launcher_rank(environ=os.environ) -> int:
    return int(environ["RANK"])


class InProcessRanks:
    """This process is one rank of the launcher's world."""

    def __init__(self, device_type: str, case_timeout: float):
        self.rank = launcher_rank()
        self.world_size = launcher_world_size()
        self.device_type = device_type
        self.case_timeout = case_timeout
        if device_type == "cuda":
            self.device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(self.device)
            os.environ.setdefault(*NCCL_ERROR_HANDLING)
        else:
            self.device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group(
                "nccl" if device_type == "cuda" else "gloo",
                timeout=timedelta(seconds=case_timeout),
                **({"device_id": self.device} if device_type == "cuda" else {}),
            )
        self.outcome_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=case_timeout + WATCHDOG_GRACE_S))
        self.group = self._new_dcp_group()

    def _new_dcp_group(self) -> DcpGroup:
        timeout = timedelta(seconds=self.case_timeout)
        device_group = dist.new_group(backend="nccl" if self.device_type == "cuda" else "gloo", timeout=timeout)
        cpu_group = dist.new_group(backend="gloo", timeout=timeout) if self.device_type == "cuda" else device_group
        return DcpGroup(self.rank, self.world_size, self.device, device_group, cpu_group)

    def run(self, world_size: int, fn, case: dict, *, seed: int, impl_spec: str, timeout: float) -> CaseResult:
        assert world_size == self.world_size, "the plugin skips other world sizes before launch"
        faulthandler.dump_traceback_later(timeout + 2 * WATCHDOG_GRACE_S, exit=True, file=sys.stderr)
        try:
            self.group.collective_calls = 0
            ctx = RankContext(self.group, self.device, load_implementation(impl_spec), seed, case)
            mine = self._run_case(fn, ctx, timeout)
            outcomes: list[RankOutcome | None] = [None] * self.world_size
            dist.all_gather_object(outcomes, _picklable(mine), group=self.outcome_group)
        finally:
            faulthandler.cancel_dump_traceback_later()
        result = CaseResult(self.world_size, outcomes={o.rank: o for o in outcomes})
        if not result.ok:
            # A failed case may have left collectives unmatched: start clean.
            self.group = self._new_dcp_group()
        return result

    def _run_case(self, fn, ctx: RankContext, timeout: float) -> RankOutcome:
        """On CUDA, abort the DCP group's communicator when the case overruns:
        the stuck collective's kernel then exits and the rank reports. NCCL's
        own watchdog cannot be relied on for it: it was seen blocked for as
        long as the main thread waited on the stuck kernel (in ``.item()``)."""
        if self.device_type != "cuda":
            return run_rank_case(fn, ctx)
        aborted = threading.Event()

        def abort_dcp_group() -> None:
            aborted.set()
            self.group.device_group.abort()

        timer = threading.Timer(timeout, abort_dcp_group)
        timer.start()
        try:
            outcome = run_rank_case(fn, ctx)
        finally:
            timer.cancel()
            timer.join()  # an abort under way finishes before the outcome is read
        if not aborted.is_set():
            return outcome
        error = (
            f"[rank {self.rank}] DistBackendError: Timed out after {timeout:g} s (typically waiting in a "
            f"collective a peer never joined); the DCP group's NCCL communicator was aborted"
        )
        return RankOutcome(
            self.rank, False, error + ("\n" + outcome.error if outcome.error else ""), None, outcome.seconds
        )

    def stop(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _picklable(outcome: RankOutcome) -> RankOutcome:
    try:
        pickle.dumps(outcome.value)
    except Exception as exc:  # noqa: BLE001 - any pickling failure means "drop the value"
        outcome.value = f"<unpicklable return value: {exc}>"
    return outcome
