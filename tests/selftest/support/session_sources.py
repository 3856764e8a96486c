"""The source of an inner session's test file that more than one self-test
writes: one multi-rank test of any world size and one of W = 2 only."""

MULTI_RANK_TESTS = """
import pytest

def one(ctx):
    return ctx.rank

def test_any_size(dcp):
    dcp.run(one)

@pytest.mark.world_sizes(2)
def test_two_only(dcp):
    dcp.run(one)
"""
