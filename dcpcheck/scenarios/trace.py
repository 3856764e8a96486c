"""Prefill batches and serving traces: the steps stage 9 and the e2e stack run.

:func:`build_prefill_batch` is one step of prefill rows as a
:class:`~dcpcheck.scenarios.batch.StepBatch` (so the batch helpers give its
block tables, attention inputs and caches). :func:`schedule_trace` plays a
small scheduler over :class:`RequestSpec` requests: they join, prefill in
chunks under a token budget, decode (several rows per step for spec decode)
and finish; every step's rows are padded like a CUDA-graph batch.
:func:`step_rows` turns one step into the tensors a layer needs. Nothing here
depends on the rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dcpcheck.scenarios.batch import KvLayout, StepBatch
from dcpcheck.scenarios.indexer import indexer_topk, uses_shortcut
from dcpcheck.scenarios.window import window_rows

# The prefill requests of build_prefill_batch, in batch order ("no state yet"
# sits between others so that its one-page minimum moves the bases after it).
PREFILL_REQUESTS = ("shorter than a page", "no state yet", "many virtual blocks", "first chunk", "one virtual block")
LONG_REQUEST = PREFILL_REQUESTS.index("many virtual blocks")


def build_prefill_batch(
    layout: KvLayout, *, top_k: int, seed: int, chunk: int = 24, long_chunk: int | None = None, num_padding: int = 1
) -> StepBatch:
    """One step of prefill rows for the requests of :data:`PREFILL_REQUESTS`.

    Continuing requests contribute their last ``chunk`` positions or fewer
    (the "many virtual blocks" one its last ``long_chunk``), "first chunk" all
    its positions from 0. Top-k rows come from the synthetic indexer; padding
    rows are invalid copies of the long request's last row. Needs bs >= 2
    (for a request shorter than a page)."""
    if layout.bs < 2:
        raise ValueError(f"bs={layout.bs}: a request shorter than a page needs bs >= 2")
    gen = torch.Generator().manual_seed(seed)

    def rand(high: int) -> int:
        return int(torch.randint(high, (1,), generator=gen)) if high > 0 else 0

    rho, virtual_block = layout.rho, layout.bs * layout.world_size
    long_chunk = long_chunk or chunk
    lengths = {
        "shorter than a page": (1 + rand(layout.bs - 1)) * rho + rand(rho),
        "no state yet": rho - 1,
        "many virtual blocks": (3 * virtual_block + rand(virtual_block) + (long_chunk + rho - 1) // rho) * rho
        + rand(rho),
        "first chunk": 2 * rho + 1 + rand(rho),
        "one virtual block": (virtual_block + 1 + rand(virtual_block)) * rho + rand(rho),
    }
    seq_lens = [lengths[name] for name in PREFILL_REQUESTS]
    new_tokens = {
        "many virtual blocks": long_chunk,
        "first chunk": lengths["first chunk"],
    }
    token_to_req, positions = [], []
    for req, (name, length) in enumerate(zip(PREFILL_REQUESTS, seq_lens)):
        rows = min(length, new_tokens.get(name, chunk - rand(chunk // 2)))
        token_to_req += [req] * rows
        positions += range(length - rows, length)
    token_to_req += [LONG_REQUEST] * num_padding
    positions += [seq_lens[LONG_REQUEST] - 1] * num_padding
    num_valid = len(positions) - num_padding

    positions_t = torch.tensor(positions, dtype=torch.int64)
    token_to_req_t = torch.tensor(token_to_req, dtype=torch.int32)
    topk = indexer_topk(positions_t, token_to_req_t, rho=rho, top_k=top_k, seed=seed)
    shortcut = uses_shortcut(positions_t, rho=rho, top_k=top_k).tolist()
    return StepBatch(
        layout=layout,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        token_to_req=token_to_req_t,
        positions=positions_t,
        is_valid_token=torch.arange(len(positions)) < num_valid,
        row_roles=("prefill",) * num_valid + ("padding",) * num_padding,
        topk_patterns=tuple("short-context" if s else "sampled" for s in shortcut),
        topk=topk,
        table_slack=1,
        table_seed=seed,
    )


# ---- serving traces ---------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    """One request of a trace."""

    uid: int
    arrival: int  # the step it joins
    prompt_len: int
    decode_steps: int  # decode steps after the prompt; it finishes after the last
    tokens_per_decode: int = 1  # > 1: spec-decode steps of that many rows (all accepted)

    @property
    def final_len(self) -> int:
        return self.prompt_len + self.decode_steps * self.tokens_per_decode


@dataclass(frozen=True)
class ScheduledRun:
    """Consecutive rows of one request in one step."""

    uid: int
    start: int  # position of the first row
    length: int
    role: str  # "prefill", "decode" or "spec-decode"


@dataclass(frozen=True)
class TraceStep:
    runs: tuple[ScheduledRun, ...]  # at most one per request, in uid order
    num_padding: int  # invalid rows after the runs
    finished: tuple[int, ...]  # uids that leave the batch after this step


def schedule_trace(requests: list[RequestSpec], *, token_budget: int, pad_to: int) -> tuple[TraceStep, ...]:
    """Every step until all requests finish: running requests decode first,
    then waiting prompts are prefilled in arrival order, chunked to fit the
    token budget; rows are padded to a multiple of ``pad_to``."""
    prefilled = {spec.uid: 0 for spec in requests}
    decoded = {spec.uid: 0 for spec in requests}
    finished: set[int] = set()
    steps = []
    step = 0
    while len(finished) < len(requests):
        present = [spec for spec in requests if spec.arrival <= step and spec.uid not in finished]
        runs, budget, leaving = {}, token_budget, []
        for spec in present:
            if prefilled[spec.uid] == spec.prompt_len and decoded[spec.uid] < spec.decode_steps:
                start = spec.prompt_len + decoded[spec.uid] * spec.tokens_per_decode
                role = "spec-decode" if spec.tokens_per_decode > 1 else "decode"
                runs[spec.uid] = ScheduledRun(spec.uid, start, spec.tokens_per_decode, role)
                budget -= spec.tokens_per_decode
                decoded[spec.uid] += 1
                if decoded[spec.uid] == spec.decode_steps:
                    leaving.append(spec.uid)
        for spec in sorted(present, key=lambda s: (s.arrival, s.uid)):
            remaining = spec.prompt_len - prefilled[spec.uid]
            if remaining and budget > 0:
                length = min(remaining, budget)
                runs[spec.uid] = ScheduledRun(spec.uid, prefilled[spec.uid], length, "prefill")
                prefilled[spec.uid] += length
                budget -= length
                if prefilled[spec.uid] == spec.prompt_len and spec.decode_steps == 0:
                    leaving.append(spec.uid)
        num_rows = sum(run.length for run in runs.values())
        steps.append(TraceStep(tuple(runs[uid] for uid in sorted(runs)), -num_rows % pad_to, tuple(leaving)))
        finished.update(leaving)
        step += 1
    return tuple(steps)


@dataclass(frozen=True)
class StepRows:
    """One step's rows as tensors (rank-independent, CPU)."""

    uids: tuple[int, ...]  # the batch's requests, in block-table row order
    seq_lens: torch.Tensor  # [R] int64: tokens after this step
    is_prefill_request: torch.Tensor  # [R] bool
    token_to_req: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int64
    is_valid_token: torch.Tensor  # [T] bool
    row_roles: tuple[str, ...]  # per row: prefill, decode, spec-decode or padding

    @property
    def row_uids(self) -> torch.Tensor:
        """[T] int64: the uid of each row's request."""
        return torch.tensor(self.uids, dtype=torch.int64)[self.token_to_req.long()]

    @property
    def row_labels(self) -> tuple[str, ...]:
        uids = self.row_uids.tolist()
        return tuple(f"{role}, uid {uid}" for role, uid in zip(self.row_roles, uids))

    def window_slots(self, window: int, swa_bases: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of a window buffer holding request ``uid``'s token ``p`` at
        ``swa_bases[uid] + p``: -> (read [T, window] int32: the row's last
        ``min(p + 1, window)`` tokens, -1 = none; write [T] int64: the row's own
        token, -1 on padding)."""
        bases = torch.tensor([swa_bases[uid] for uid in self.uids], dtype=torch.int64)[self.token_to_req.long()]
        read = window_rows(self.positions, self.is_valid_token, bases, window).to(torch.int32)
        write = torch.where(self.is_valid_token, bases + self.positions, -1)
        return read, write


def step_rows(step: TraceStep) -> StepRows:
    """The rows of ``step``; padding rows are invalid and look like the first
    request's last row."""
    uids = tuple(run.uid for run in step.runs)
    token_to_req, positions, roles = [], [], []
    for req, run in enumerate(step.runs):
        token_to_req += [req] * run.length
        positions += range(run.start, run.start + run.length)
        roles += [run.role] * run.length
    num_valid = len(positions)
    token_to_req += [0] * step.num_padding
    positions += [step.runs[0].start + step.runs[0].length - 1] * step.num_padding
    return StepRows(
        uids=uids,
        seq_lens=torch.tensor([run.start + run.length for run in step.runs], dtype=torch.int64),
        is_prefill_request=torch.tensor([run.role == "prefill" for run in step.runs], dtype=torch.bool),
        token_to_req=torch.tensor(token_to_req, dtype=torch.int32),
        positions=torch.tensor(positions, dtype=torch.int64),
        is_valid_token=torch.arange(len(positions)) < num_valid,
        row_roles=tuple(roles) + ("padding",) * step.num_padding,
    )


def swa_regions(requests: list[RequestSpec]) -> tuple[dict[int, int], int]:
    """A window buffer region per request, big enough for all its tokens:
    -> (first row of each uid's region, rows in all)."""
    bases, total = {}, 0
    for spec in requests:
        bases[spec.uid] = total
        total += spec.final_len
    return bases, total
