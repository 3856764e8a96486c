"""Stage 1 at the production profile: the partition checks (:mod:`dcpcheck.checks.partition`) of one served
step (:func:`dcpcheck.scenarios.production.production_step`): MTP verifications at the far end of requests
past 2^17 tokens, the longest at ``max_model_len``, a decode and a chunked prefill's chunk, top-k rows of the
served widths, every rank's block table as wide as vLLM's row at that ``max_model_len``.

Index filtering and the write-side slot mapping are integer work, so the profile's own values run on every
host: the ranks filter ``[T, 2048]`` top-k rows over rows of thousands of pages, and ``slot_mapping`` places
every state of every request (about 700,000 at ``max_model_len`` 300,000).
"""

from __future__ import annotations

from dcpcheck.checks.partition import check_partition_of_batch
from dcpcheck.oracle.layout import pages_needed
from dcpcheck.scenarios.batch import rank_block_table
from dcpcheck.scenarios.production import (
    POSITION_MARK,
    PROFILES,
    production_step,
    served_block_table,
    served_table_width,
)


def check_production_index(ctx, *, profile: str, rho: int, top_k: int, interleave_tokens: int) -> dict:
    """The stage-1 partition of a production step at ``profile`` (a name of
    :data:`~dcpcheck.scenarios.production.PROFILES`), ratio ``rho`` and a ``--cp-kv-cache-interleave-size``
    of ``interleave_tokens``. -> counts of what the case covered."""
    profile = PROFILES[profile]
    W = ctx.world_size
    layout = profile.kv_layout(rho, W, interleave_tokens)
    batch = production_step(profile, layout, top_k=top_k, seed=ctx.seed)
    width = served_table_width(profile, W)
    tables = [served_block_table(rank_block_table(batch, rank), width, seed=ctx.seed + rank) for rank in range(W)]
    case = (
        f"stage 1 production case W={W} I={interleave_tokens} tokens (S={layout.interleave} states) "
        f"bs={layout.bs} K={top_k} rho={rho} max_model_len={profile.max_model_len} table width={width} "
        f"seed={ctx.seed}, on rank {ctx.rank}"
    )
    covered = check_partition_of_batch(ctx, batch, tables, case)

    # The scenario still covers what it claims to: rows past 2^17, and the longest request's pages
    # reaching the last column of vLLM's row on some rank.
    if int(batch.positions.max()) < POSITION_MARK:
        raise AssertionError(f"{case}: no row past position 2^17")
    longest = int(batch.num_states.max())
    reached = max(int(pages_needed(longest, rank, layout.bs, layout.interleave, W)) for rank in range(W))
    if reached != width:
        raise AssertionError(f"{case}: the longest request fills {reached} columns of a {width}-page row, not all")
    return {**covered, "table_width": width, "max_position": int(batch.positions.max())}
