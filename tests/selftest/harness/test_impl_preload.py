"""The implementation is loaded once per zygote server, before any zygote or
rank is forked from it (vLLM's import is seconds of CPU per rank), and one
server serves every world size, on CPU and on CUDA (where each world size's
ranks get their own thread count); an implementation whose import
initialises CUDA is loaded by each rank after its fork instead, and its
cases run (``dcpcheck/ranks/zygote_server.py``)."""

from __future__ import annotations

import pytest

from tests.selftest.support.inner import run_inner_pytest, write_session

pytestmark = pytest.mark.spawned_only

# Records the process that imported it; initialises CUDA at import where asked.
RECORDING_IMPL = """
import os

from dcpcheck.port.impl import EmbeddedPort

IMPORTED_IN = os.getpid()
if os.environ.get("INIT_CUDA_AT_IMPORT") == "1":
    import torch

    torch.zeros(1, device="cuda")


class Recording(EmbeddedPort):
    name = "recording"
"""

TESTS = """
import os
import sys

import pytest
import torch

from dcpcheck.ranks.procstate import parent_pid

SERVERS = []


def expected_threads(dcp) -> int:  # what the pool gives each rank of this world size (dcpcheck/ranks/pool.py)
    if dcp.device_type == "cpu":
        return 1
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // (workers * dcp.world_size)))


def expected_wait_policy(dcp) -> str | None:  # idle OpenMP threads sleep on CUDA (dcpcheck/ranks/host_threads.py)
    users = os.environ.get("OMP_WAIT_POLICY")
    return (users or "PASSIVE") if dcp.device_type == "cuda" else users


def where_loaded(ctx) -> dict:
    module = sys.modules[type(ctx.impl).__module__]
    server = parent_pid(os.getppid())
    loaded_in = {os.getpid(): "rank", server: "server"}.get(module.IMPORTED_IN, f"process {module.IMPORTED_IN}")
    # The server's environment: what libgomp read when the server imported torch, and its forks inherit.
    server_env = dict(item.split("=", 1) for item in open(f"/proc/{server}/environ").read().split("\\0") if "=" in item)
    return {
        "loaded in": loaded_in,
        "server": server,
        "threads": torch.get_num_threads(),
        "wait policy": server_env.get("OMP_WAIT_POLICY"),
    }


@pytest.mark.world_sizes(1, 2)
def test_loaded_where_expected(dcp):
    answers = dcp.run(where_loaded)
    assert {answer["loaded in"] for answer in answers} == {os.environ["EXPECT_LOADED_IN"]}, answers
    assert [answer["threads"] for answer in answers] == [expected_threads(dcp)] * dcp.world_size, answers
    assert [answer["wait policy"] for answer in answers] == [expected_wait_policy(dcp)] * dcp.world_size, answers
    SERVERS.append(answers[0]["server"])


def test_one_server_forked_every_world_size():
    assert len(SERVERS) == 2 and len(set(SERVERS)) == 1, SERVERS
"""


def _run(tmp_path, *args, **env) -> tuple[int, str]:
    write_session(tmp_path, {"test_inner.py": TESTS, "recording.py": RECORDING_IMPL})
    return run_inner_pytest(tmp_path, ["--dcp-impl", "recording.py:Recording", "--world-sizes", "1,2", *args], **env)


def test_the_server_loads_the_implementation_before_forking(tmp_path):
    code, output = _run(tmp_path, EXPECT_LOADED_IN="server")
    assert code == 0 and "3 passed" in output, output


@pytest.mark.gpu
def test_on_cuda_one_server_forks_every_world_size_with_its_own_thread_count(tmp_path):
    code, output = _run(tmp_path, "--device", "cuda", EXPECT_LOADED_IN="server")
    assert code == 0 and "3 passed" in output, output


@pytest.mark.gpu
def test_an_implementation_that_initialises_cuda_at_import_is_loaded_by_each_rank(tmp_path):
    code, output = _run(tmp_path, "--device", "cuda", EXPECT_LOADED_IN="rank", INIT_CUDA_AT_IMPORT="1")
    assert code == 0 and "3 passed" in output, output
