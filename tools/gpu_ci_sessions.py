"""The GPU CI's session table (``tools/gpu_ci.py``): which steps (named sets of
test paths) run in which session, pytest process or torchrun job, with which
arguments and in which wave; and the order a session hands its files out in
when this host has measured none."""

from __future__ import annotations

from dataclasses import dataclass

from dcpcheck.stages import E2E_TEST_DIR, STAGE_TEST_DIRS, SUITE_TEST_DIRS


@dataclass(frozen=True)
class Step:
    """A named set of test paths (globs relative to the repo): the summary's
    unit. Its cases are told apart from other steps' by their test files."""

    name: str
    paths: tuple[str, ...]


@dataclass(frozen=True)
class Session:
    """One pytest process (or one torchrun job) running some steps' tests.
    ``extra_args`` and ``env`` are its own (e.g. another ``--dcp-impl``)."""

    name: str
    steps: tuple[Step, ...]
    torchrun: bool = False
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    workers_share: float = 1.0  # of --workers
    wave: int = 0  # sessions of one wave run at once, the waves one after another


# The self-tests of what runs on the device: the harness (ranks, pools, GPU placement, torchrun), the suite's
# checks, the dsv41 adapter and kernels, the Triton interpreter as this host's Triton runs it. Not
# tests/selftest/tools: the host tools' own self-tests (the tree builder, the carry, diff coverage, gpu_ci's
# summary) touch no device and run in the CPU CI (.ci/run).
SELFTEST_ON_DEVICE = tuple(f"tests/selftest/{kind}" for kind in ("harness", "checks", "dsv41", "interpreter"))
POOL_STEPS = (
    Step("harness", SELFTEST_ON_DEVICE),
    *(Step(f"stage{stage}", (folder,)) for stage, folder in STAGE_TEST_DIRS.items()),
    Step("e2e", (E2E_TEST_DIR,)),
    Step("realistic", ("tests/gpu/test_*.py",)),
)
# A session hands its files to the xdist workers in command-line order
# (DCPCHECK_XDIST_SPREAD): the longest go first, so the short files fill in
# around them; the rest follow by step. Longest by the durations measured on
# this host for the session's device and implementation
# (dcpcheck/plugin/file_durations.py); without them (a clean clone), these,
# the longest on one H200, first.
LONGEST_FIRST = (
    "tests/selftest/harness/test_rank_failures.py",
    "tests/selftest/harness/test_no_orphans.py",
    "tests/selftest/harness/test_session_end.py",
    "tests/gpu/test_stage9_realistic.py",
    "tests/e2e/test_serving_trace.py",
    "tests/selftest/harness/test_session_setup.py",
    "tests/gpu/test_stage3_realistic.py",
    "tests/gpu/test_stage1_realistic.py",
    "tests/selftest/harness/test_torchrun_mode.py",
    "tests/stage3_combine/test_combine.py",
    "tests/stage1_index/test_partition.py",
)
STAGE_PATHS = SUITE_TEST_DIRS
# Under torchrun the stage tests and the realistic ones (about as long, serial
# either way) run as two jobs side by side.
TORCHRUN_STEPS = (Step("torchrun", STAGE_PATHS), Step("torchrun-gpu", ("tests/gpu",)))
# The stage tests against an installed vLLM tree and its DCP2 port (tools/carry_vllm.py
# carries both to a GPU host); run only where vLLM imports. In a second wave,
# after the pool and torchrun sessions (every rank process imports vLLM on
# CUDA: beside the pool session 10 workers' pools, about 150 ranks, ran one
# H200 out of memory at pool starts). dsv41 has the longest cases (its serving
# traces run the tree's own stack): more of the workers.
VLLM_SESSIONS = (
    Session(
        "vllm", (Step("vllm", STAGE_PATHS),), extra_args=("--dcp-impl", "vllm", "-rfExX"), workers_share=0.5, wave=1
    ),
    Session(
        "dsv41", (Step("dsv41", STAGE_PATHS),), extra_args=("--dcp-impl", "dsv41", "-rfExX"), workers_share=0.8, wave=1
    ),
)
# The production profile (tests/production: DSV4.1's served shapes, lengths and KV pools) against the real port
# (dsv41, every W, in wave 1 beside the vllm and dsv41 sessions; its stage-1 cases, light on GPU memory, in a
# session of their own in wave 0, whose sessions but the pool session end by half-time: on an H100 at 8a3ae70
# wave 1 ran 285 s against wave 0's 283, its cores and memory shared by one more session) and the embedded port
# (port, W = 2: the users' DCP2, in wave 0 beside the pool session, whose long cases are lighter). Their cases are
# few and large (7 to 10 GiB a rank): one worker each, and the GPU ledger (dcpcheck/ranks/gpu_ledger.py) runs a
# case only where its declared memory fits beside the running cases'. The folder runs from W = 8 down
# (tests/production/conftest.py): a W = 8 case needs nearly all of an H100, which the ledger gives it by keeping
# every other process from starting ranks meanwhile, at the start of wave 1, before the other sessions' pools
# hold some 45 GiB (beside them, at the end of the session, one ran out of memory: H100, at 1b1ce93). The
# sessions' own --world-sizes win over the run's.
PRODUCTION_ARGS = ("--dcp-timeout", "300", "-rfExX")  # 300 s: after the run's, so it wins
PRODUCTION_SESSIONS = tuple(
    Session(
        name,
        (Step(name, paths),),
        extra_args=(*PRODUCTION_ARGS, "--dcp-impl", impl, "--world-sizes", world_sizes),
        workers_share=0.0,  # no xdist: one worker
        wave=wave,
    )
    for name, impl, world_sizes, wave, paths in (
        (
            "production",
            "dsv41",
            "1,2,4,8",
            1,
            ("tests/production/test_production.py", "tests/production/test_production_trace.py"),
        ),
        ("production-index", "dsv41", "1,2,4,8", 0, ("tests/production/test_production_index.py",)),
        ("production-port", "port", "2", 0, ("tests/production",)),
    )
)
# The sessions that run only where vLLM imports.
NEEDS_VLLM = (*VLLM_SESSIONS, *(session for session in PRODUCTION_SESSIONS if "dsv41" in session.extra_args))
# The steps whose summary adds wall time and peak GPU memory per W.
PER_WORLD_STEPS = tuple(session.name for session in PRODUCTION_SESSIONS)
SESSIONS = (
    Session("pool", POOL_STEPS),
    *(Session(step.name, (step,), torchrun=True) for step in TORCHRUN_STEPS),
    *VLLM_SESSIONS,
    *PRODUCTION_SESSIONS,
)
STEP_NAMES = tuple(dict.fromkeys(step.name for session in SESSIONS for step in session.steps))
