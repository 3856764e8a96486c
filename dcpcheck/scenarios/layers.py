"""A small DSV4.1-like layer stack's data: every layer's q, KV and sinks.

Every token of every request has, per layer, a query ``[H, D]`` and a latent
row ``[D]`` (its window row: key and value). A compressed state is the mean
of the latent rows of the ``rho`` tokens it covers (:func:`compress_states`,
the one definition). All of it is drawn from the seed, per layer and request
uid, so every rank and the DCP1 baseline see the same numbers whatever the
step layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dcpcheck.oracle.kv_cache import stored_values
from dcpcheck.oracle.prefill import dense_state_slots
from dcpcheck.scenarios.batch import KvLayout
from dcpcheck.scenarios.indexer import indexer_topk
from dcpcheck.scenarios.trace import RequestSpec, StepRows
from dcpcheck.scenarios.window import window_rows


@dataclass(frozen=True)
class LayerLayout:
    """What ``build_attention`` gets for one layer; rho 0 is SWA only. Not
    validated here: validating it is the implementation's job."""

    rho: int
    bs: int
    interleave: int
    world_size: int

    def kv_layout(self) -> KvLayout:
        return KvLayout(rho=self.rho, bs=self.bs, interleave=self.interleave, world_size=self.world_size)


@dataclass(frozen=True)
class LayerSpec:
    """One layer of the stack: rho 0 (SWA only), or a compressed layer reading
    an indexer top-k: DSV4.1's ratios 1 and 2 (:mod:`dcpcheck.scenarios.topology`),
    or DeepSeek-V4.0's shapes the generic checks use, 4 (C4A) and 128 (C128A:
    every state, so ``top_k`` must cover the longest request)."""

    rho: int
    bs: int = 1
    interleave: int = 1
    top_k: int = 0
    # An earlier layer of the stack whose compressed cache this one reads, as
    # DSV4.1's layers read their kv source's: it writes no compressed state of
    # its own. Same layout as that layer.
    kv_source: int | None = None
    # An earlier layer whose top-k this one reads from the model-wide buffer
    # (DSV4.1's index source): it publishes none of its own. None: its own.
    index_source: int | None = None

    @property
    def compressed(self) -> bool:
        return self.rho >= 1

    def layout(self, world_size: int) -> LayerLayout:
        return LayerLayout(self.rho, self.bs, self.interleave, world_size)


def compress_states(latent: torch.Tensor, rho: int) -> torch.Tensor:
    """[L, D] token latents -> [L // rho, D]: state c is the mean of tokens
    [c*rho, (c+1)*rho), computed in float64 and rounded once to latent.dtype."""
    num_states = latent.shape[0] // rho
    grouped = latent[: num_states * rho].to(torch.float64).view(num_states, rho, latent.shape[1])
    return grouped.mean(dim=1).to(latent.dtype)


@dataclass(frozen=True)
class LayerStepInputs:
    """One layer's inputs for one step, all heads (CPU)."""

    q: torch.Tensor  # [T, H, D]; zeros on padding rows
    sink: torch.Tensor  # [H] fp32, natural-log logits
    kv: torch.Tensor  # [T, D]: each row's latent (its window row)
    states: torch.Tensor | None  # [T, D]: the state the row's position completes; NaN where none does
    topk: torch.Tensor | None  # [T, K] int32 global state ids, -1 = none


class LayerTensors:
    """Every request's data for one layer of the stack."""

    def __init__(
        self,
        spec: LayerSpec,
        requests: list[RequestSpec],
        *,
        num_heads: int,
        head_dim: int,
        seed: int,
        rounded_to: torch.dtype | None = None,
        kv_cache_format: str | None = None,
        kv_from: LayerTensors | None = None,
        topk_from: LayerTensors | None = None,
        common_component: float = 0.0,
    ):
        """``rounded_to``: the dtype the layer under test computes in; q, the
        latents and the states are drawn in fp32 and rounded through it, so
        the oracle reads exactly what that layer reads. ``kv_cache_format``:
        the packed record the layer's caches hold (:mod:`dcpcheck.oracle.kv_cache`);
        the latents and states are then drawn as it gives them back, for the
        same reason. ``kv_from``: the
        kv-source layer's data, whose latents and states this layer shares;
        ``topk_from``: the index-source layer's data, whose top-k it reads.
        ``common_component``: the value of dimension 0 of every q and latent
        row (0: drawn like the others); every q·k gains its square, which
        moves every LSE up and leaves the softmax over the candidates as it was."""
        self.spec = spec
        self.seed = seed
        self.topk_seed = seed if topk_from is None else topk_from.topk_seed
        self.writes_states = kv_from is None
        gen = torch.Generator().manual_seed(seed)
        self.sink = torch.rand(num_heads, generator=gen) * 4.0 - 1.0  # about the mass of a few candidates

        def rounded(x: torch.Tensor) -> torch.Tensor:
            return x if rounded_to is None else x.to(rounded_to).to(x.dtype)

        def cached(x: torch.Tensor) -> torch.Tensor:
            return rounded(x) if kv_cache_format is None else stored_values(rounded(x), kv_cache_format)

        self.q, self.latent, self.states = {}, {}, {}
        for request in requests:
            self.q[request.uid] = rounded(torch.randn(request.final_len, num_heads, head_dim, generator=gen))
            if common_component:
                self.q[request.uid][..., 0] = common_component
            if kv_from is not None:
                self.latent[request.uid], self.states[request.uid] = (
                    kv_from.latent[request.uid],
                    kv_from.states[request.uid],
                )
                continue
            latent = torch.randn(request.final_len, head_dim, generator=gen)
            if common_component:
                latent[:, 0] = common_component
            self.latent[request.uid] = cached(latent)
            if spec.compressed:
                self.states[request.uid] = cached(compress_states(self.latent[request.uid], spec.rho))
                if spec.rho == 128 and request.final_len // spec.rho > spec.top_k:
                    raise ValueError(
                        f"C128A reads every state: top_k={spec.top_k} < {request.final_len // spec.rho} states"
                    )

    def step_inputs(self, rows: StepRows) -> LayerStepInputs:
        valid = rows.is_valid_token
        uids, positions = rows.row_uids.tolist(), rows.positions.tolist()
        q = torch.stack([self.q[uid][p] for uid, p in zip(uids, positions)])
        latent = torch.stack([self.latent[uid][p] for uid, p in zip(uids, positions)])
        q[~valid] = 0.0
        states = topk = None
        if self.spec.compressed:
            rho = self.spec.rho
            completed = [self.states[uid][p // rho] if (p + 1) % rho == 0 else None for uid, p in zip(uids, positions)]
            states = torch.stack(
                [row if row is not None else torch.full_like(latent[0], float("nan")) for row in completed]
            )
            topk = indexer_topk(rows.positions, rows.row_uids, rho=rho, top_k=self.spec.top_k, seed=self.topk_seed)
            topk[~valid] = topk[0].clone()  # padding rows carry real-looking ids
            if not self.writes_states:
                states = None  # the kv-source layer writes them
        return LayerStepInputs(q=q, sink=self.sink, kv=latent, states=states, topk=topk)

    def dense_candidates(self, rows: StepRows, inputs: LayerStepInputs, window: int):
        """The DCP1 view without paging, for the float64 oracle: ``(comp_cache,
        comp_slots, swa_cache, swa_slots)`` where request i's states and
        tokens so far are rows of dense arrays (no compressed part at rho 0)."""
        lengths = rows.seq_lens
        token_offsets = torch.cumsum(lengths, 0) - lengths
        swa_cache = torch.cat([self.latent[uid][:length] for uid, length in zip(rows.uids, lengths.tolist())])
        swa_slots = window_rows(rows.positions, rows.is_valid_token, token_offsets[rows.token_to_req.long()], window)
        if not self.spec.compressed:
            return None, None, swa_cache, swa_slots
        num_states = lengths // self.spec.rho
        state_offsets = torch.cumsum(num_states, 0) - num_states
        states = torch.cat([self.states[uid][:n] for uid, n in zip(rows.uids, num_states.tolist())])
        if states.shape[0] == 0:  # no request has a state yet: no compressed candidate at all
            return None, None, swa_cache, swa_slots
        comp_slots = dense_state_slots(inputs.topk, rows.token_to_req, rows.is_valid_token, state_offsets)
        return states, comp_slots, swa_cache, swa_slots
