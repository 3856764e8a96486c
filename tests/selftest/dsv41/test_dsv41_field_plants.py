"""The field's 2026 DCP bugs (docs/field-bugs.md rows 69-71) planted in the port's own file of a
scratch tree, each failing the dsv41 test that replays its class, where the seed tree passes that
test. A plant is data, as in ``test_dsv41_held_out_port_bugs.py``.

* ``sub_chunks_read_the_first_queries`` (vllm#54300: long prompts corrupt, short ones clean): the
  stage-3 prefill loop hands every ``DCP_PREFILL_TOKEN_CHUNK`` sub-chunk the first sub-chunk's
  queries; only a request chunk longer than the sub-chunk meets it, which
  ``test_prefill_on_both_sides_of_every_routing_edge`` builds;
* ``owner_of_interleave_one`` (vllm#56715: with interleave 64, token 1 read the key of token 64):
  the gathered prefill's remap takes a state's owner as ``off % W``, an interleave of 1, while
  the cache was written with the configured interleave;
* ``gathered_pages_cast`` (local-inference-lab/vllm#16, vllm#44044: the chunked-context prefill's
  copy between caches of two dtypes): the gathered prefill casts the rank's fp8_ds_mla record
  pages to bf16, so the kernel is handed a cache that is not the record it was told."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.selftest.support.scratch_trees import NEEDS_VLLM_AND_SEED, replace_in_tree, run_dsv41, seed_tree

pytestmark = NEEDS_VLLM_AND_SEED

PORT_FILE = "vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py"
ROUTING_EDGES = "tests/stage9_prefill/test_routing_thresholds.py::test_prefill_on_both_sides_of_every_routing_edge[W2]"
WIDE_INTERLEAVE = "tests/e2e/test_serving_trace.py::test_dsv41_wide_interleave_gather_trace[W2-I64]"
RATIO1_GATHER = "tests/e2e/test_serving_trace.py::test_dsv41_ratio1_trace[W2-gather]"


@dataclass(frozen=True)
class FieldPlant:
    name: str
    correct: str  # its one occurrence in the seed tree's port file
    planted: str
    test: str  # the suite test that replays the class
    shows: tuple[str, ...]  # in the failing session's output


PLANTS = (
    FieldPlant(
        "sub_chunks_read_the_first_queries",
        "q[sub_start:sub_end],",
        "q[qs : qs + sub_end - sub_start],",
        ROUTING_EDGES,
        ("MismatchError",),
    ),
    FieldPlant(
        "owner_of_interleave_one",
        "owner = (off // K) % W",
        "owner = off % W",
        WIDE_INTERLEAVE,
        ("MismatchError",),
    ),
    FieldPlant(
        "gathered_pages_cast",
        "local = pool.index_select(0, page_ids).contiguous()",
        "local = pool.index_select(0, page_ids).to(torch.bfloat16)",
        RATIO1_GATHER,
        ("RecordFormatError: compressed_kv_cache is torch.bfloat16", "neither the DSV4 record"),
    ),
)


@pytest.mark.parametrize("test", sorted({plant.test for plant in PLANTS}))
def test_the_seed_tree_passes_the_tests_that_replay_the_field_bugs(tmp_path, test):
    done = run_dsv41(seed_tree(tmp_path / "tree"), test, 2)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-4000:]


@pytest.mark.parametrize("plant", PLANTS, ids=lambda plant: plant.name)
def test_a_planted_field_bug_fails_the_test_that_replays_it(tmp_path, plant):
    tree = seed_tree(tmp_path / "tree")
    replace_in_tree(tree, PORT_FILE, plant.correct, plant.planted)
    done = run_dsv41(tree, plant.test, 2)
    assert done.returncode == 1 and "1 failed" in done.stdout, done.stdout[-4000:]
    missing = [text for text in plant.shows if text not in done.stdout]
    assert not missing, f"{missing} not in: {done.stdout[-4000:]}"
