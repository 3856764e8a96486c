"""The xdist groups of ``dcpcheck/plugin/xdist_groups.py``: under gpu_ci's many workers
(``DCPCHECK_XDIST_SPREAD=1``) a file's world sizes are groups of their own,
the largest handed out first, so no whole multi-W file sets the wall time."""

from __future__ import annotations

from collections import OrderedDict

from dcpcheck.plugin.xdist_groups import next_group, spread_group, widest_of_the_first_file

COMBINE = "tests/stage3_combine/test_combine.py"
REALISTIC = "tests/gpu/test_stage3_realistic.py"


def test_a_stage_file_is_a_group_per_world_size():
    assert spread_group(f"{COMBINE}::test_combine_matches_oracle_merge[W8-ag_rs-2-fp32]") == f"{COMBINE} W8"
    assert spread_group(f"{COMBINE}::test_combine_head_counts[W2-12]") == f"{COMBINE} W2"
    assert spread_group(f"{COMBINE}::test_without_ranks") == COMBINE


def test_a_realistic_file_is_split_by_model_where_a_rank_holds_most():
    assert spread_group(f"{REALISTIC}::test_decode[W2-v4.1-2-bf16]") == f"{REALISTIC} W2 v4.1"
    assert spread_group(f"{REALISTIC}::test_decode[W8-v4.1-2-bf16]") == f"{REALISTIC} W8"


def test_the_first_files_widest_group_goes_first():
    queue = OrderedDict.fromkeys(
        [f"{COMBINE} W1", f"{COMBINE} W2", f"{COMBINE} W8", f"{REALISTIC} W8", COMBINE, f"{COMBINE} W4"]
    )
    order = sorted(queue, key=widest_of_the_first_file(queue))
    assert order == [f"{COMBINE} W8", f"{COMBINE} W4", f"{COMBINE} W2", f"{COMBINE} W1", COMBINE, f"{REALISTIC} W8"]


def test_a_realistic_files_parts_keep_their_order():
    parts = [f"{REALISTIC} W2 v4.0", f"{REALISTIC} W4", f"{REALISTIC} W8"]
    queue = OrderedDict.fromkeys(parts)
    assert sorted(queue, key=widest_of_the_first_file(queue)) == parts


def test_a_worker_takes_a_group_of_its_last_world_size_among_the_next_ones():
    partition = "tests/stage1_index/test_partition.py"
    queue = OrderedDict.fromkeys([f"{partition} W{w}" for w in (8, 4, 2, 1)] + [f"{COMBINE} W{w}" for w in (8, 4)])
    key = widest_of_the_first_file(queue)
    assert next_group(queue, key, last_world=None, workers=4) == f"{partition} W8"
    assert next_group(queue, key, last_world=2, workers=4) == f"{partition} W2"
    # Beyond the next `workers` groups it waits its turn: the longest go first.
    assert next_group(queue, key, last_world=8, workers=1) == f"{partition} W8"
    del queue[f"{partition} W8"]
    assert next_group(queue, key, last_world=8, workers=2) == f"{partition} W4"
    assert next_group(queue, key, last_world=8, workers=5) == f"{COMBINE} W8"


def test_a_realistic_files_parts_are_not_taken_out_of_turn():
    queue = OrderedDict.fromkeys([f"{REALISTIC} W2 v4.0", f"{REALISTIC} W4", f"{REALISTIC} W8"])
    assert next_group(queue, widest_of_the_first_file(queue), last_world=8, workers=3) == f"{REALISTIC} W2 v4.0"
