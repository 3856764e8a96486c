"""Stage-1 mutants: index filtering (read side) and slot mapping (write side).

``_locate_state`` (port/index.py) is shared by the read and the write side,
so its bugs reach both; the prefill remap locates states without it.
"""

from __future__ import annotations

from functools import partial

from dcpcheck.mutants.patch import Mutant, Patch
from dcpcheck.stages import STAGE_INDEX, STAGE_TEST_DIRS

index_mutant = partial(Mutant, stage=STAGE_INDEX, home=STAGE_TEST_DIRS[STAGE_INDEX])

MUTANTS = (
    index_mutant(
        name="OwnerModW",
        description="owner(c) computed as c % W instead of (c // S) % W, on the read and the write side",
        patch=Patch("index.py", "(owner == rank)", "(state % world_size == rank)"),
    ),
    index_mutant(
        name="LocalIndexNoInterleave",
        description="local(c) computed as c // W, without the interleave: (c // (S*W)) * S + c % S",
        patch=Patch(
            "index.py",
            "    owner, local = owner_and_local(state, world_size, interleave)\n",
            "    owner, _ = owner_and_local(state, world_size, interleave)\n    local = state // world_size\n",
        ),
    ),
    index_mutant(
        name="CountIncludesMinusOne",
        description="a -1 top-k entry is not excluded: with S > 1 rank 0 'owns' it, counts it and reads a bogus slot",
        patch=Patch("index.py", "candidate & (state >= 0) & (owner == rank)", "candidate & (owner == rank)"),
    ),
    index_mutant(
        name="OutOfRangePageRead",
        description="a state whose page lies past the end of the block-table row is read (next row's page), not dropped",
        patch=Patch("index.py", "mine = owned & (page < max_blocks)", "mine = owned"),
    ),
    index_mutant(
        name="PrefixGapsAcrossTiles",
        description="each top-k tile compacts into its own columns: with K > tile the prefix has gaps and loses ids",
        patch=Patch("index.py", "dest = count[:, None] + tl.cumsum", "dest = k0 + tl.cumsum"),
    ),
    index_mutant(
        name="TopkTilesCapped",
        description="the top-k loop stops after 4 filter tiles (sized for a narrower checkpoint's index_topk): "
        "rows of vLLM's DCP widths 1024 and 2048 lose their later ids",
        patch=Patch("index.py", "    while k0 < top_k:\n", "    while k0 < tl.minimum(top_k, 4 * TILE):\n"),
    ),
    index_mutant(
        name="CountAllValidIds",
        description="count = every valid id of the row (the stage-9 remap's count), not the ids this rank owns",
        patch=Patch(
            "index.py",
            "count += tl.sum(keep, axis=1)",
            "count += tl.sum((candidate & (ids >= 0)).to(tl.int32), axis=1)",
        ),
    ),
    index_mutant(
        name="PaddedRowsNotZeroed",
        description="is_valid_token ignored: padding rows get their real-looking ids' slots and a count > 0",
        patch=Patch("index.py", "candidate = in_bounds & is_valid[:, None]", "candidate = in_bounds"),
    ),
    index_mutant(
        name="StateWrittenAtFirstToken",
        description="write side stores state p // rho at p % rho == 0 (before it is complete) instead of (p+1) % rho == 0",
        patch=Patch("index.py", "((position + 1) % rho == 0)", "(position % rho == 0)"),
    ),
)
