"""One scheduler step's batch: requests, token rows, their top-k, block tables.

A :class:`StepBatch` does not depend on the rank: every rank builds the same
one from the same seed, then takes its own view with :func:`rank_block_table`
(and the DCP1 baseline its view with :func:`dcp1_block_table`).

:func:`build_step_batch` mixes the rows a DCP layer meets: decode (position
``L - 1``), spec decode (consecutive positions of one request), prefill chunks
(one starting at position 0, one continuing), a request with no state yet, and
CUDA-graph padding rows (``is_valid_token = False``, with real-looking ids).
Their top-k rows hold ``-1`` anywhere, few ids, ids of one rank only (empty
shards elsewhere), or the newest states (the last page of every rank).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from dcpcheck.oracle.layout import owner_of_state, pages_needed

# What the top-k row of a token holds.
TOPK_PATTERNS = (
    "sampled",  # random visible ids, about a quarter of the columns -1, scattered
    "full",  # min(K, visible) random ids: no -1 once K states are visible
    "short",  # one to three ids, scattered
    "recent",  # the newest min(K, visible) states, in random columns
    "short-context",  # [0, 1, ..., n-1, -1, ...]: the indexer's shortcut when n <= K
    "one-rank",  # ids owned by a single rank, so every other rank's shard is empty
    "empty",  # all -1
)


@dataclass(frozen=True)
class KvLayout:
    """How one layer's compressed KV cache is spread over the DCP ranks."""

    rho: int  # compress ratio: state c covers tokens [c*rho, (c+1)*rho)
    bs: int  # states per page on one rank
    interleave: int  # S: runs of S consecutive states stay on one rank
    world_size: int  # W

    def __post_init__(self):
        if self.rho < 1:
            raise ValueError(f"rho={self.rho}: a compressed layer has rho >= 1")
        if self.bs < 1 or self.interleave < 1 or self.bs % self.interleave:
            raise ValueError(f"bs={self.bs}, S={self.interleave}: need bs % S == 0 and both >= 1")
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size}: need W >= 1")

    @property
    def cycle(self) -> int:
        """States in one round over all ranks (S * W)."""
        return self.interleave * self.world_size


@dataclass(frozen=True)
class StepBatch:
    """The rank-independent description of one step's batch (CPU tensors
    unless moved with :meth:`to`)."""

    layout: KvLayout
    seq_lens: torch.Tensor  # [R] int64: tokens of each request after this step
    token_to_req: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int64
    is_valid_token: torch.Tensor  # [T] bool: False on CUDA-graph padding rows
    row_roles: tuple[str, ...]  # per row: "decode", "spec-decode", "prefill" or "padding"
    topk_patterns: tuple[str, ...]  # per row, one of TOPK_PATTERNS
    topk: torch.Tensor  # [T, K] int32 global state ids visible at the row's position, -1 = none
    table_slack: int  # block-table columns beyond the most any request needs on a rank; < 0 cuts pages
    table_seed: int

    @property
    def num_states(self) -> torch.Tensor:
        """[R] int64: compressed states of each request (``L // rho``)."""
        return self.seq_lens // self.layout.rho

    @property
    def num_tokens(self) -> int:
        return self.topk.shape[0]

    @property
    def top_k(self) -> int:
        return self.topk.shape[1]

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def row_labels(self) -> tuple[str, ...]:
        """Per row, what it is in words (for failure messages)."""
        return tuple(f"{role}, {pattern} ids" for role, pattern in zip(self.row_roles, self.topk_patterns))

    def to(self, device) -> StepBatch:
        tensors = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{name: t.to(device) for name, t in tensors.items() if isinstance(t, torch.Tensor)})


def select_rows(batch: StepBatch, rows: slice | torch.Tensor) -> StepBatch:
    """The same requests and block tables with only some token rows
    (a slice, an index tensor or a bool mask over rows)."""
    index = torch.arange(batch.num_tokens)[rows]
    return replace(
        batch,
        token_to_req=batch.token_to_req[index],
        positions=batch.positions[index],
        is_valid_token=batch.is_valid_token[index],
        row_roles=tuple(batch.row_roles[i] for i in index.tolist()),
        topk_patterns=tuple(batch.topk_patterns[i] for i in index.tolist()),
        topk=batch.topk[index],
    )


def rank_block_table(batch: StepBatch, rank: int) -> torch.Tensor:
    """Rank ``rank``'s block table ``[R, width] int32``: distinct, shuffled
    physical pages; width = the most pages a request needs on this rank plus
    ``table_slack`` (spare columns hold unused pages; a negative slack leaves
    the longest requests' rows too short)."""
    layout = batch.layout
    needed = pages_needed(batch.num_states, rank, layout.bs, layout.interleave, layout.world_size)
    return _shuffled_pages(needed, batch.table_slack, _table_generator(batch.table_seed, rank))


def dcp1_block_table(batch: StepBatch) -> torch.Tensor:
    """The DCP1 baseline's block table: every state on one rank, never too short."""
    needed = pages_needed(batch.num_states, 0, batch.layout.bs, batch.layout.interleave, 1)
    return _shuffled_pages(needed, max(batch.table_slack, 0), _table_generator(batch.table_seed, -1))


def _table_generator(table_seed: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed((table_seed * 1_000_003 + rank + 1) % 2**63)


def _shuffled_pages(needed: torch.Tensor, slack: int, generator: torch.Generator) -> torch.Tensor:
    width = max(int(needed.max()) + slack, 0) if needed.numel() else 0
    count = needed.numel() * width
    # Draw from a larger pool so the physical page ids are not a dense range.
    pages = torch.randperm(count + count // 2 + 1, generator=generator)[:count]
    return pages.view(needed.numel(), width).to(torch.int32)


def build_step_batch(
    layout: KvLayout, *, top_k: int, seed: int, num_decodes: int = 4, table_slack: int = 2
) -> StepBatch:
    """A deterministic mixed batch (same ``seed`` -> same batch on every rank).

    Request lengths scale with ``S * W`` and ``top_k`` so that the states span
    several rounds over the ranks and rows can sample from more than ``K``
    ids. ``num_decodes`` extra decode requests (random lengths, every
    top-k pattern in turn) grow the batch past one kernel block of tokens.
    """
    builder = _BatchBuilder(layout, top_k, torch.Generator().manual_seed(seed))
    rho, cycle, rand = layout.rho, layout.cycle, builder.randint

    # The longest request by a margin, so that a negative slack cuts its newest states.
    longest = builder.add_request(states=3 * cycle + 2 * top_k + rand(cycle) + 1)
    builder.add_rows(longest, ["recent"], role="decode")
    builder.add_rows(builder.add_request(states=cycle + top_k + rand(cycle)), ["sampled"], role="decode")
    builder.add_rows(builder.add_request(states=1 + rand(top_k)), ["short-context"], role="decode")
    spec = builder.add_request(states=2 * cycle + rand(top_k + 1) + 1)
    builder.add_rows(spec, ["full", "one-rank", "short"], role="spec-decode")
    builder.add_padding_row()
    for i in range(num_decodes):
        pattern = TOPK_PATTERNS[i % len(TOPK_PATTERNS)]
        builder.add_rows(builder.add_request(states=rand(2 * cycle + top_k + 1)), [pattern], role="decode")
    no_state_yet = builder.add_request(states=0, extra_tokens=max(rho - 1, 1))
    builder.add_rows(no_state_yet, ["sampled"], role="decode")
    continuing_rows = ["sampled", "one-rank", "recent", "full", "short", "empty"]
    # At least one token per row (at ratio 1 a short cycle has fewer states than rows).
    continuing = builder.add_request(states=max(cycle + rand(2 * top_k + 1) + 1, -(-len(continuing_rows) // rho)))
    builder.add_rows(continuing, continuing_rows, role="prefill")
    first_chunk = builder.add_request(tokens=6)
    builder.add_rows(first_chunk, ["short-context"] * 6, role="prefill")
    builder.add_padding_row()
    builder.add_padding_row()
    return builder.build(table_slack=table_slack, table_seed=seed)


class _BatchBuilder:
    """Accumulates requests and rows; rows of one request end at its last token."""

    def __init__(self, layout: KvLayout, top_k: int, generator: torch.Generator):
        self.layout = layout
        self.top_k = top_k
        self.generator = generator
        self.seq_lens: list[int] = []
        self.rows: list[tuple[int, int, bool, str, str, torch.Tensor]] = []

    def randint(self, high: int) -> int:
        """Uniform in [0, high), 0 when high <= 0."""
        return int(torch.randint(high, (1,), generator=self.generator)) if high > 0 else 0

    def add_request(
        self, *, states: int | None = None, tokens: int | None = None, extra_tokens: int | None = None
    ) -> int:
        """A request of ``tokens`` tokens, or of ``states`` states plus
        ``extra_tokens`` (random in [0, rho) by default) toward the next one."""
        if tokens is None:
            extra = self.randint(self.layout.rho) if extra_tokens is None else extra_tokens
            tokens = states * self.layout.rho + extra
        self.seq_lens.append(tokens)
        return len(self.seq_lens) - 1

    def add_rows(self, req: int, patterns: list[str], *, role: str) -> None:
        """One row per pattern, at the request's last ``len(patterns)`` positions."""
        length = self.seq_lens[req]
        for offset, pattern in enumerate(patterns):
            position = length - len(patterns) + offset
            visible = (position + 1) // self.layout.rho
            self.rows.append((req, position, True, role, pattern, self._topk_row(pattern, visible)))

    def add_padding_row(self) -> None:
        """An invalid row that looks real: request 0, position 0, ids of request 0."""
        visible = self.seq_lens[0] // self.layout.rho
        self.rows.append((0, 0, False, "padding", "sampled", self._topk_row("sampled", visible)))

    def _topk_row(self, pattern: str, visible: int) -> torch.Tensor:
        k = self.top_k
        if pattern == "sampled":
            return self._scatter(self._randperm(visible)[: min(visible, k - k // 4)])
        if pattern == "full":
            return self._scatter(self._randperm(visible)[: min(visible, k)])
        if pattern == "short":
            return self._scatter(self._randperm(visible)[: min(visible, k, 1 + self.randint(3))])
        if pattern == "recent":
            return self._scatter(torch.arange(max(visible - k, 0), visible))
        if pattern == "short-context":
            row = torch.full((k,), -1, dtype=torch.int64)
            row[: min(visible, k)] = torch.arange(min(visible, k))
            return row
        if pattern == "one-rank":
            layout = self.layout
            target = self.randint(layout.world_size)
            ids = torch.arange(visible)
            ids = ids[owner_of_state(ids, layout.interleave, layout.world_size) == target]
            return self._scatter(ids[self._randperm(ids.numel())][: k - k // 4])
        if pattern == "empty":
            return torch.full((k,), -1, dtype=torch.int64)
        raise ValueError(f"unknown top-k pattern {pattern!r}; known: {TOPK_PATTERNS}")

    def _randperm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.generator)

    def _scatter(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` in random columns of a K-wide row, -1 elsewhere."""
        row = torch.full((self.top_k,), -1, dtype=torch.int64)
        row[self._randperm(self.top_k)[: ids.numel()]] = ids
        return row

    def build(self, *, table_slack: int, table_seed: int) -> StepBatch:
        reqs, positions, valid, roles, patterns, topk_rows = zip(*self.rows)
        return StepBatch(
            layout=self.layout,
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int64),
            token_to_req=torch.tensor(reqs, dtype=torch.int32),
            positions=torch.tensor(positions, dtype=torch.int64),
            is_valid_token=torch.tensor(valid, dtype=torch.bool),
            row_roles=roles,
            topk_patterns=patterns,
            topk=torch.stack(topk_rows).to(torch.int32),
            table_slack=table_slack,
            table_seed=table_seed,
        )
