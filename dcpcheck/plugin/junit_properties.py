"""The names of the properties the plugin records on each case (pytest's
``user_properties``, written to ``--junitxml``): what the stage table,
``tools/gpu_ci.py`` and ``tools/mutation_report.py`` read back."""

from __future__ import annotations

STAGE = "dcp_stage"  # the case's stage (its test's stage marker)
WORLD_SIZE = "dcp_world_size"
RANKS = "dcp_ranks"  # where its ranks ran (Placement.describe)
BACKEND = "dcp_backend"  # a combine case's backend parameter
# Keys of a rank function's stats dict that are worst errors: the largest over
# the ranks is recorded as dcp_<key>.
WORST_ERROR_KEYS = ("worst_ratio", "max_abs_err")
# Prefix of a case's peak GPU memory, in bytes, per GPU (dcp_gpu_peak_bytes:cuda:0).
GPU_PEAK_PREFIX = "dcp_gpu_peak_bytes:"
# One of a case's Triton interpreter fallbacks, "kernel: why" (several a case):
# a vectorised kernel's specialisation that its ranks run as shipped.
INTERPRETER_FALLBACK = "dcp_triton_fallback"
# Where a case's time went, each recorded as dcp_<phase>: the pool it started
# (RankPool.startup's keys) and the slowest rank's compiles; how often that
# start was tried again for want of device memory; and how many idle pools
# were ended first to free GPU memory for the case.
PHASES = (
    "pool_start_s",
    "cuda_init_s",
    "group_init_s",
    "compile_s",
    "out_of_memory_retries",
    "idle_pools_ended",
    "gpu_ledger_wait_s",
)


def measured(key: str) -> str:
    """The property of a worst error or a phase: ``dcp_<key>``."""
    return f"dcp_{key}"
