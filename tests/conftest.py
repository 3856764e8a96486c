"""``pytest -n 2 --dist loadgroup`` (the README's test command) runs each
test file as a group on one xdist worker, longest first; gpu_ci's many
workers (``DCPCHECK_XDIST_SPREAD=1``) run each file's world sizes as groups
of their own. How: :mod:`dcpcheck.plugin.xdist_groups`."""

from __future__ import annotations

import pytest

from dcpcheck.plugin.xdist_groups import path_groups_scheduler

# The cold-start order (no measured durations: a clean clone, or a session
# whose device and implementation never ran whole): the longest files on 2
# CPU cores (their cases' seconds under --durations) first; the others follow
# in xdist's order (the most tests first). Measured durations replace it:
# dcpcheck/plugin/file_durations.py.
LONGEST_FILES = (
    "tests/e2e/test_serving_trace.py",
    "tests/selftest/harness/test_session_end.py",
    "tests/selftest/harness/test_torchrun_ranks_agree.py",
    "tests/selftest/harness/test_rank_failures.py",
    "tests/selftest/harness/test_no_orphans.py",
    "tests/selftest/harness/test_zygote_server.py",
    "tests/selftest/harness/test_torchrun_mode.py",
    "tests/selftest/harness/test_session_setup.py",
    "tests/stage1_index/test_partition.py",
    "tests/selftest/harness/test_pool_out_of_memory.py",
    "tests/stage9_prefill/test_prefill_attention.py",
    "tests/stage3_combine/test_combine.py",
    "tests/stage3_combine/test_sharded_attention.py",
)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadgroup":
        return None  # xdist's own
    return path_groups_scheduler(config, log, LONGEST_FILES)
