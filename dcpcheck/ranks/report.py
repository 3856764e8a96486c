"""The failure message of a multi-rank case: what ran, where, and what broke."""

from __future__ import annotations

from dcpcheck.ranks.launcher import Case, CaseResult


def format_case_failure(result: CaseResult, case: Case) -> str:
    """One message naming the case, the failing ranks and each rank's error."""
    lines = [case.describe()]
    lines.append("case: " + (", ".join(f"{k}={v!r}" for k, v in case.params.items()) or "(no parameters)"))
    failed = sorted(r for r, o in result.outcomes.items() if not o.ok)
    passed = sorted(r for r, o in result.outcomes.items() if o.ok)
    summary = []
    if failed:
        summary.append(f"failing ranks {failed}")
    if result.dead:
        summary.append(f"dead ranks {sorted(result.dead)}")
    if result.silent:
        summary.append(f"ranks {sorted(result.silent)} sent no report")
    if result.stuck:
        why = (
            f"timed out after {case.timeout:g} s"
            if result.timed_out
            else "still running after a peer failed (waiting in a collective the failed rank never joined)"
        )
        summary.append(f"ranks {sorted(result.stuck)} did not finish: {why}")
    if passed:
        summary.append(f"ranks {passed} passed")
    lines.append("; ".join(summary))
    for rank in failed:
        lines.append(result.outcomes[rank].error.rstrip())
    for rank, how in sorted(result.dead.items()):
        lines.append(f"[rank {rank}] worker died: {how}")
    for rank, why in sorted(result.silent.items()):
        lines.append(f"[rank {rank}] {why}")
    for rank, stack in sorted(result.stuck.items()):
        lines.append(f"[rank {rank}] Python stacks at the timeout:\n{stack}")
    if result.stop_session:
        lines.append(f"the session stops after this test: {result.stop_session}")
    return "\n".join(lines)
