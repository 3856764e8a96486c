"""The stage registry and the ``DSV41_DCP_STAGE`` gate of the suite.

``DSV41_DCP_STAGE=N`` says the implementation under test has reached stage N:
tests of stages <= N must pass, later ones are skipped. Unset means all.
"""

from __future__ import annotations

import os

STAGE_ENV = "DSV41_DCP_STAGE"

STAGE_INDEX = 1
STAGE_COMBINE = 3
STAGE_PREFILL = 9

STAGES: dict[int, str] = {
    STAGE_INDEX: "index filtering",
    STAGE_COMBINE: "partial attention + LSE combine",
    STAGE_PREFILL: "prefill via compressed-KV gather",
}

# Where each stage's tests live, relative to the repository root.
STAGE_TEST_DIRS: dict[int, str] = {
    STAGE_INDEX: "tests/stage1_index",
    STAGE_COMBINE: "tests/stage3_combine",
    STAGE_PREFILL: "tests/stage9_prefill",
}
# The whole stack through a serving trace; its tests carry the stage they check.
E2E_TEST_DIR = "tests/e2e"
# The staged suite the main job runs: not the harness self-tests, not tests/gpu.
SUITE_TEST_DIRS = (*STAGE_TEST_DIRS.values(), E2E_TEST_DIR)


class StageValueError(ValueError):
    """``DSV41_DCP_STAGE`` holds something that is not a non-negative integer."""


def parse_stage(raw: str | None) -> int | None:
    """The reached stage, or None (all stages) when unset or empty."""
    if raw is None or raw.strip() == "":
        return None
    text = raw.strip()
    if not (text.isascii() and text.isdigit()):  # str.isdigit() alone accepts '³' and '٣'
        raise StageValueError(
            f"{STAGE_ENV}={raw!r} is not a stage: accepted values are a "
            f"non-negative integer N (tests of stages <= N run, later ones are "
            f"skipped; known stages: {describe_stages()}) or unset (all stages)"
        )
    return int(text)


def reached_stage(environ=os.environ) -> int | None:
    return parse_stage(environ.get(STAGE_ENV))


def describe_stages() -> str:
    return ", ".join(f"{n} = {name}" for n, name in STAGES.items())


def stage_label(stage: int) -> str:
    return f"stage {stage} ({STAGES.get(stage, 'unregistered')})"


def skip_reason(stage: int, reached: int) -> str:
    return (
        f"{STAGE_ENV}={reached}: {stage_label(stage)} is not reached yet; "
        f"set {STAGE_ENV}>={stage} or unset it to run this test"
    )
