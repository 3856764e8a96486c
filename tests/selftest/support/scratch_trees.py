"""Scratch DCP2 trees for the self-tests of ``--dcp-impl dsv41``: the seed
diff applied to the installed vLLM by ``tools/build_dsv41_tree.sh``, then one
of the tree's files edited as a porter's stack would (a planted bug, a piece
of the stack). Needs vLLM on CPU (``tools/install_vllm_cpu.sh``) and the seed
diff beside the checkout; ``.ci/run`` runs these self-tests after installing vLLM."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.selftest.support.inner import inner_env

ROOT = Path(__file__).resolve().parents[3]
SEED_DIFF = ROOT.parent / "shared" / "seeds" / "002_ce6637cb7dfa2225.txt"

NEEDS_VLLM_AND_SEED = [
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="needs vLLM on CPU (tools/install_vllm_cpu.sh); .ci/run runs this file after installing it",
    ),
    pytest.mark.skipif(
        not SEED_DIFF.is_file(), reason=f"needs the seed diff at {SEED_DIFF} (shared/ beside the checkout)"
    ),
]


def seed_tree(folder: Path) -> Path:
    """vLLM with the seed diff applied, in ``folder`` (links to the installed vLLM but for the port's file)."""
    build = [str(ROOT / "tools" / "build_dsv41_tree.sh"), str(folder), str(SEED_DIFF), sys.prefix]
    subprocess.run(build, check=True, capture_output=True)
    return folder


def replace_in_tree(tree: Path, path: str, old: str, new: str) -> None:
    """The tree's ``path`` (``vllm/...``) with its one ``old`` text replaced by ``new``: a file of its own."""
    file = tree / path
    source = file.read_text()
    assert source.count(old) == 1, f"vLLM's {path} changed: edit this test"
    file.unlink()  # a link to the installed vLLM's file: the tree gets its own
    file.write_text(source.replace(old, new))


def run_dsv41(tree: Path, node: str, world_size: int) -> subprocess.CompletedProcess:
    """One suite test (``node``) on ``tree``'s port at one world size, in a session of its own, CPU only."""
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--dcp-impl", "dsv41"]
    command += ["--dcp-timeout", "900", "--world-sizes", str(world_size), node]
    env = inner_env(PYTHONPATH=f"{tree}:{ROOT}", CUDA_VISIBLE_DEVICES="")
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def run_dsv41_nodes(tree: Path, nodes: list[str], world_sizes: str) -> subprocess.CompletedProcess:
    """Suite tests (``nodes``) on ``tree``'s port at ``world_sizes`` ("1,2"), in one session of their own, CPU only."""
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rf", "--dcp-impl", "dsv41"]
    command += ["--dcp-timeout", "900", "--world-sizes", world_sizes, *nodes]
    env = inner_env(PYTHONPATH=f"{tree}:{ROOT}", CUDA_VISIBLE_DEVICES="")
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
