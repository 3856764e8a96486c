"""Stage-9 mutants: the prefill gather (geometry, buffer, id remap) in
port/prefill.py, and the non-gather prefill path in sub-chunks
(``dcp_attention``, port/attention.py)."""

from __future__ import annotations

from functools import partial

from dcpcheck.mutants.patch import Mutant, Patch
from dcpcheck.stages import STAGE_PREFILL, STAGE_TEST_DIRS

prefill_mutant = partial(Mutant, stage=STAGE_PREFILL, home=STAGE_TEST_DIRS[STAGE_PREFILL])

MUTANTS = (
    prefill_mutant(
        name="PagesWithoutMinimum",
        description="a request with no state yet gets 0 pages (no one-page minimum): its gather moves 0 bytes",
        patch=Patch(
            "prefill.py",
            "torch.clamp((states + states_per_virtual_block - 1) // states_per_virtual_block, min=1)",
            "(states + states_per_virtual_block - 1) // states_per_virtual_block",
        ),
    ),
    prefill_mutant(
        name="PagesFromTokens",
        description="pages_i sized from the request length L in tokens instead of its L // rho states",
        patch=Patch("prefill.py", "states = seq_lens.to(torch.int64) // rho", "states = seq_lens.to(torch.int64)"),
    ),
    prefill_mutant(
        name="GatherBlockMajor",
        description="the gathered buffer interleaves the ranks' pages (block-major) while the remap expects rank-major",
        patch=Patch(
            "prefill.py",
            "owner, vblock = within // pages[requests], within % pages[requests]",
            "owner, vblock = within % world, within // world",
        ),
    ),
    prefill_mutant(
        name="MissingRequestBase",
        description="the remap omits base_i: every request's ids land in the first request's pages",
        patch=Patch(
            "prefill.py",
            "slot = (bases[:, None] + owner * pages[:, None] + vblock) * bs + local_offset",
            "slot = (owner * pages[:, None] + vblock) * bs + local_offset",
        ),
    ),
    prefill_mutant(
        name="VblockOffsetSwapped",
        description="the remap swaps virtual block and in-page offset: slot = (base + owner*pages + loff)*bs + vblock",
        patch=Patch(
            "prefill.py",
            "slot = (bases[:, None] + owner * pages[:, None] + vblock) * bs + local_offset",
            "slot = (bases[:, None] + owner * pages[:, None] + local_offset) * bs + vblock",
        ),
    ),
    prefill_mutant(
        name="LastSubChunkDropped",
        description="the non-gather prefill loop stops before a last sub-chunk shorter than the chunk size",
        patch=Patch(
            "attention.py",
            "for start in range(0, num_tokens, step):",
            "for start in range(0, num_tokens - step + 1, step):",
        ),
    ),
)
