"""The ``dcp`` fixture: runs a rank function on W ranks and turns what comes
back into one pass, skip, expected failure or failure message."""

from __future__ import annotations

import dataclasses
import sys
import threading
import traceback

import pytest

from dcpcheck.case_terms import case_terms
from dcpcheck.impls.protocol import KnownFailure
from dcpcheck.plugin import junit_properties as prop
from dcpcheck.plugin.impl_answers import AnswerError, plain_answer
from dcpcheck.plugin.known_failures import BEHIND_KNOWN_DEFECT, behind_known_defect, declare
from dcpcheck.plugin.markers import gpu_gib_needed, needed_capabilities, scenario_properties
from dcpcheck.plugin.session import DcpSession, dcp_session, seed_for_test
from dcpcheck.ranks.launcher import Case
from dcpcheck.stages import stage_label


class ThreadedCall:
    """``fn(*args)`` in a daemon thread, so that the caller can stop waiting."""

    def __init__(self, fn, *args):
        self._value, self._error = None, None
        self._thread = threading.Thread(target=self._call, args=(fn, args), name=f"dcpcheck {fn.__name__}", daemon=True)
        self._thread.start()

    def _call(self, fn, args) -> None:
        try:
            self._value = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            self._error = exc

    def finished(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def result(self):
        if self._error is not None:
            raise self._error
        return self._value

    def stack(self) -> str:
        frame = sys._current_frames().get(self._thread.ident)
        return "".join(traceback.format_stack(frame)).rstrip() if frame is not None else "(it has just returned)"


class DcpRunner:
    """The ``dcp`` fixture: runs a rank function on ``world_size`` ranks."""

    def __init__(self, request, session: DcpSession, world_size: int):
        self.world_size = world_size
        self.session = session
        self.impl = session.impl
        self.device_type = session.device_type
        self.nodeid = request.node.nodeid
        self.seed = seed_for_test(session, self.nodeid)
        stage_marker = request.node.get_closest_marker("stage")
        self.stage = stage_marker.args[0] if stage_marker else None
        self._node = request.node

    def _header(self) -> dict:
        return {
            "stage": stage_label(self.stage) if self.stage is not None else "harness",
            "W": self.world_size,
            "device": self.session.placement(self.world_size).describe(),
            "impl": self.session.impl_spec,
            "mode": self.session.mode.name,
            "seed": self.seed,
        }

    def case(self, params: dict, *, timeout: float | None = None) -> Case:
        """One run of this test's rank function with ``params``."""
        return Case(
            nodeid=self.nodeid,
            stage=self.stage,
            world_size=self.world_size,
            seed=self.seed,
            timeout=timeout or self.session.timeout,
            params=params,
            terms=case_terms(
                device=self.device_type,
                world_size=self.world_size,
                capabilities=needed_capabilities(self._node),
                properties=scenario_properties(self._node),
                case=params,
            ),
            header=self._header(),
            gpu_gib_needed=gpu_gib_needed(self._node, self.session.placement(self.world_size)),
        )

    def run(self, fn, *, timeout: float | None = None, **params) -> list:
        """Run ``fn(ctx, **params)`` on every rank; fail unless all ranks pass.
        Returns each rank's return value, in rank order."""
        from dcpcheck.ranks.launcher import LaunchError
        from dcpcheck.ranks.report import format_case_failure

        case = self.case(params, timeout=timeout)
        launcher = self.session.launcher()
        try:
            reason, defect, failure = launcher.decide_before_launch(case, lambda: self._answers_before_launch(case))
        except LaunchError as exc:
            reason, defect, failure = None, None, str(exc)
        if failure:
            pytest.fail(f"{case.describe()}\n{failure}", pytrace=False)
        if reason:
            pytest.skip(reason)
        if defect:
            # The check still runs: a failure is reported as xfailed with
            # this reason, a pass as XPASS (the defect may be fixed).
            self._node.add_marker(pytest.mark.xfail(reason=f"known defect of {self.session.impl_spec}: {defect}"))
            declare(self._node, defect)
        self._node.user_properties.append((prop.WORLD_SIZE, self.world_size))
        self._node.user_properties.append((prop.RANKS, self.session.placement(self.world_size).describe()))
        if params.get("backend"):
            self._node.user_properties.append((prop.BACKEND, params["backend"]))
        if isinstance(defect, KnownFailure) and defect.cures:
            case = dataclasses.replace(case, first_failure_suffices=True)
        try:
            result = launcher.run(fn, case)
        except LaunchError as exc:
            result, launch_error = None, str(exc)
        if result is None:  # failed outside the except block: the LaunchError is not shown again as its context
            pytest.fail(f"{case.describe()}\n{launch_error}", pytrace=False)
        if result.stop_session:
            self._node.session.shouldstop = result.stop_session
        self._record_phases(result)  # failed cases too: their pool start and compiles took time alike
        self._record_interpreter_fallbacks(result)
        if not result.ok:
            failure = format_case_failure(result, case)
            if isinstance(defect, KnownFailure) and defect.cures:
                self._run_cured(launcher, fn, case, defect, failure)
            pytest.fail(failure, pytrace=False)
        values = [result.outcomes[rank].value for rank in range(self.world_size)]
        self._record_worst_errors(values)
        self._record_gpu_peaks(result)
        return values

    def _run_cured(self, launcher, fn, case: Case, defect: KnownFailure, failure: str) -> None:
        """The case once more with its known defects' causes neutralised: it
        must pass, or a second bug hides behind them (the test then fails
        whatever its first run showed)."""
        from dcpcheck.ranks.launcher import LaunchError
        from dcpcheck.ranks.report import format_case_failure

        cured_case = dataclasses.replace(case, cures=defect.cures, first_failure_suffices=False)
        try:
            cured = launcher.run(fn, cured_case)
        except LaunchError as exc:
            cured_failure = str(exc)
        else:
            if cured.ok:
                return
            cured_failure = format_case_failure(cured, cured_case)
        behind_known_defect(self._node)
        pytest.fail(
            f"{BEHIND_KNOWN_DEFECT}: with {self.session.impl_spec}'s cures {', '.join(defect.cures)} (the known "
            f"defect's cause neutralised: {defect.reason}) the case still fails:\n{cured_failure}\n\n"
            f"the run with the known defect:\n{failure}",
            pytrace=False,
        )

    def _answers_before_launch(self, case: Case) -> tuple:
        """-> (why the case is unavailable, its known defect, why asking
        failed), each a string or None (the defect may be a KnownFailure):
        plain values, which torchrun's rank 0 shares with every rank."""
        reason, failure = self._ask("unavailable_reason", case.terms, case.timeout)
        if reason or failure:
            return reason, None, failure
        defect, failure = self._ask("known_defect", case.terms, case.timeout)
        return None, defect, failure

    def _ask(self, method: str, terms, timeout: float) -> tuple:
        """-> (the implementation's answer to ``method(terms)``, as plain data,
        None), or (None, why asking failed): it raised, answered something of
        the wrong kind, or did not return within the case timeout (its stack
        then says where it hangs)."""
        from dcpcheck.ranks.rankfn import describe_exception

        ask = getattr(self.impl, method, None)
        if ask is None:
            return None, None
        where = self.session.mode.answers_asked
        asked = f"{self.session.impl_spec}.{method}(terms)"
        answer = ThreadedCall(plain_answer, method, ask, terms)
        if not answer.finished(timeout):
            return None, (
                f"{asked} did not return within {timeout:g} s (it is asked before launch, {where}); "
                f"its stack:\n{answer.stack()}"
            )
        try:
            return answer.result(), None
        except AnswerError as exc:
            return None, f"{asked} {exc}"
        except KeyboardInterrupt:
            raise  # a Ctrl-C stays one
        except BaseException as exc:  # noqa: BLE001 - the implementation's error (a sys.exit() too) fails this test, naming it
            trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
            raised = describe_exception(exc, of_rank_function=False)
            return None, f"{asked} raised {raised} (it is asked before launch, {where})\n{trace}"

    def _record_worst_errors(self, values: list) -> None:
        for key in prop.WORST_ERROR_KEYS:
            found = [v[key] for v in values if isinstance(v, dict) and isinstance(v.get(key), (int, float))]
            if found:
                self._node.user_properties.append((prop.measured(key), max(found)))

    def _record_phases(self, result) -> None:
        phases = dict(result.pool_startup)
        compiled = max((o.compile_seconds for o in result.outcomes.values()), default=0.0)
        if compiled:  # interpreted kernels (CPU) compile nothing
            phases["compile_s"] = compiled
        for phase in prop.PHASES:
            if phase in phases:
                self._node.user_properties.append((prop.measured(phase), round(phases[phase], 4)))

    def _record_interpreter_fallbacks(self, result) -> None:
        found = {fallback for outcome in result.outcomes.values() for fallback in outcome.interpreter_fallbacks}
        for fallback in sorted(found):
            self._node.user_properties.append((prop.INTERPRETER_FALLBACK, fallback))

    def _record_gpu_peaks(self, result) -> None:
        """Per GPU, the sum of its ranks' peaks (they ran at the same time)."""
        peaks: dict[str, int] = {}
        for outcome in result.outcomes.values():
            if outcome.gpu is not None:
                peaks[outcome.gpu] = peaks.get(outcome.gpu, 0) + outcome.gpu_peak_bytes
        for gpu, peak in sorted(peaks.items()):
            self._node.user_properties.append((f"{prop.GPU_PEAK_PREFIX}{gpu}", peak))


@pytest.fixture
def dcp(request) -> DcpRunner:
    return DcpRunner(request, dcp_session(request.config), request.param)
