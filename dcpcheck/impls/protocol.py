"""The capabilities an implementation under test may provide.

An implementation is one object; each capability is a method of that name.
A capability that is missing (no attribute, or the attribute is ``None``)
skips the tests that need it, with a reason; it never crashes the run.

Conventions shared by every capability (DESIGN.md section 1):

* ``bs`` is states per page on one rank, ``S`` the interleave
  (``cp_kv_cache_interleave_size``), ``W`` the DCP world size, ``r`` the rank.
* ``-1`` in an index tensor means "no candidate"; slot tensors are int32.
* LSEs are fp32, base 2 unless a ``lse_base`` argument says otherwise; an
  empty row has ``out = 0`` and ``lse = -1e30`` (``-inf`` must work too).
* ``group`` is a :class:`dcpcheck.ranks.group.DcpGroup`, which has the vLLM
  ``GroupCoordinator`` surface, so vLLM functions accept it unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from dcpcheck.stages import STAGE_COMBINE, STAGE_INDEX, STAGE_PREFILL

# capability name -> the stage whose tests need it.
CAPABILITIES: dict[str, int] = {
    "filter_index": STAGE_INDEX,
    "slot_mapping": STAGE_INDEX,
    "gather_heads": STAGE_COMBINE,
    "sparse_attention": STAGE_COMBINE,
    "partial_attention": STAGE_COMBINE,
    "combine": STAGE_COMBINE,
    "fused_combine": STAGE_COMBINE,
    "dcp_attention": STAGE_COMBINE,
    "prefill_geometry": STAGE_PREFILL,
    "prefill_gather": STAGE_PREFILL,
    "prefill_remap": STAGE_PREFILL,
    "build_attention": STAGE_COMBINE,
    "serving_probes": STAGE_INDEX,
}

LSE_BASES = (2.0, math.e)
COMBINE_BACKENDS = ("ag_rs", "a2a")

# Named properties of a case's scenario, declared by the tests with
# ``@pytest.mark.scenario(name, ...)``: what a known defect or an unavailable
# case can depend on beyond the case's numbers.
SCENARIO_PROPERTIES: dict[str, str] = {
    "short_table": "a block-table row is shorter than its request's pages: ids on the cut pages are read "
    "by no rank and written by none",
    "garbage_under_sentinel": "rows where every rank's partial is empty (LSE at the -1e30 sentinel) "
    "with NaN or random outputs under it",
    "tree_combine_context": "the combine launch context the port keeps per layer, launched twice on this host",
    "tree_backend_agreement": "two DCP ranks launched with different DSV41_DCP_COMBINE / DSV41_DCP_PREFILL_GATHER, "
    "the collectives of one step of each compared",
    "port_heads": "the combine at a DCP2 port's own head count (H = 8 x W, bf16, base 2), run through the "
    "port's fused step where it has one",
    "lse_near_150": "partial LSEs of magnitude about 150, where fp32 values are 1.5e-5 apart",
    "rounded_once": "a 16-bit combine held to one rounding of the exact merge (compare.py's out_rounded_once): "
    "summing or rescaling in the 16-bit dtype fails it",
    "cancelling_terms": "16-bit partials whose weighted terms b^(lse_r - L) * out_r cancel: each lies 7/16 of an "
    "ulp from the 16-bit value nearest it, all on one side, and those values sum to exactly 0 in any order, so a "
    "merge that rounds each term to the dtype leaves the 'out' tolerance on every element",
    "dsv41_ratio2": "DeepSeek-V4.1 compressed layers of ratio 2 (a state is two tokens, so the interleave's "
    "unit matters), written and read at W > 1",
    "tree_compressed_writer": "the compressed write side the tree serves with (its DSV4.1 metadata builder), "
    "against vLLM's DCP placement",
    "tree_read_unit": "the interleave unit the port's read side uses, against vLLM's DCP writer",
    "tree_swa_placement": "where the tree's KV-cache spec keeps the sliding-window cache under DCP, against "
    "where the port reads it",
    "stage3_prefill_trace": "a serving trace whose prefill rows go through the stage-3 combine in token "
    "sub-chunks, every row of every compressed layer",
    "tree_kernel_call": "the port's call of the attention kernel, against the installed kernel library's signature",
    "tree_kernel_envelope": "the served model's shapes at start-up, against the attention kernel's specialisations",
    "adjacent_index_sources": "two index sources of one KV group (one step metadata object), each publishing "
    "its own top-k into the one model-wide top-k buffer in the same step",
    "v40_ratios": "layers of DeepSeek-V4.0's compress ratios 4 (C4A) and 128 (C128A), which DeepSeek-V4.1 "
    "does not have: generic checks of the DCP primitives",
    "stage_value_empty": "DSV41_DCP_STAGE set to the empty string (which means unset)",
    "stage_value_not_integer": "DSV41_DCP_STAGE set to something that is not a non-negative integer",
}


# How a known defect that lives in a library the implementation calls, at call
# sites the implementation never produces, begins: the stage table counts such
# expected failures on a line of their own, apart from the implementation's.
NOT_ON_PORT_PATH = "vLLM function, not on the port's path"


@dataclass(frozen=True)
class KnownFailure:
    """A known defect, as ``known_defect`` answers it: why the case fails
    (``reason``, the expected failure's text) and how (``shows``, a regular
    expression the failure's text matches when this defect is the cause). A
    case marked with it that fails without a match fails: a known defect
    explains its own failure and never hides another bug. Both are strings;
    the harness matches ``shows`` in a child process with a time bound
    (``dcpcheck.plugin.known_failures.MATCH_TIMEOUT_S``), so a pattern that
    backtracks without bound fails its case rather than hanging it.

    ``cures``: the implementation's names for its switches that neutralise
    the defect's cause (``Implementation.cured(cures)``, the code as it would
    be with the defect fixed). A case marked with a cured defect that fails as
    the defect shows runs once more, cured, and must then pass: a failure of
    the cured run is a second bug behind the known one."""

    reason: str
    shows: str
    cures: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.reason

    @staticmethod
    def joined(answers) -> KnownFailure | None:
        """Several defects of one case: either may be what fails it. Cured only
        where each of them is (a cured run must pass)."""
        answers = [answer for answer in answers if answer]
        if len(answers) < 2:
            return answers[0] if answers else None
        cured = all(answer.cures for answer in answers)
        return KnownFailure(
            "; and ".join(answer.reason for answer in answers),
            "|".join(f"(?:{answer.shows})" for answer in answers),
            tuple(dict.fromkeys(cure for answer in answers for cure in answer.cures)) if cured else (),
        )


@dataclass(frozen=True)
class CaseTerms:
    """A case in the contract's terms, as the harness hands it to
    ``unavailable_reason`` and ``known_defect`` before launch (and a rank
    function to ``unavailable_reason`` before it calls a capability): never
    rank-function names or test parameter spellings, so renaming a test
    changes no answer. ``None`` means the case does not pick that term."""

    device: str  # "cpu" | "cuda"
    world_size: int  # W
    capabilities: frozenset[str]  # the capabilities the case calls (a test's needs marker)
    backend: str | None = None  # combine backend, one of COMBINE_BACKENDS
    lse_base: float | None = None  # one of LSE_BASES
    dtype: torch.dtype | None = None  # of the attention inputs and partials
    head_dim: int | None = None  # D
    properties: frozenset[str] = frozenset()  # names from SCENARIO_PROPERTIES


@runtime_checkable
class DcpImplementation(Protocol):
    """Signatures of all capabilities (an implementation may have a subset)."""

    name: str

    # ---- stage 1: index filtering -------------------------------------
    def filter_index(
        self,
        topk: torch.Tensor,  # [T, K] int32 global state ids, -1 = none
        token_to_req: torch.Tensor,  # [T] int32
        block_table: torch.Tensor,  # [R, max_blocks] int32, this rank's
        is_valid_token: torch.Tensor,  # [T] bool
        *,
        bs: int,
        world_size: int,
        rank: int,
        interleave: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (slots [T, K] int32: owned slots compacted to a prefix, -1 after;
        counts [T] int32). Invalid tokens get count 0; ids whose local page
        falls outside the block table row are dropped."""

    def slot_mapping(
        self,
        positions: torch.Tensor,  # [T] int64 token positions
        token_to_req: torch.Tensor,  # [T] int32
        block_table: torch.Tensor,  # [R, max_blocks] int32, this rank's
        *,
        rho: int,
        bs: int,
        world_size: int,
        rank: int,
        interleave: int,
    ) -> torch.Tensor:
        """-> [T] int64: the slot this rank writes the compressed state
        completed at position p into (state p // rho when (p+1) % rho == 0 and
        this rank owns it), else -1."""

    # ---- stage 3: partial attention + combine ---------------------------
    def gather_heads(self, x: torch.Tensor, group, *, dim: int = 1) -> torch.Tensor:
        """All-gather over heads in TP order: q [T, H_loc, D] -> [T, H, D]
        (dim=1), sinks [H_loc] -> [H] (dim=0)."""

    def sparse_attention(
        self,
        q: torch.Tensor,  # [T, H, D]
        comp_cache: torch.Tensor,  # [N, D] compressed KV rows (key == value)
        comp_slots: torch.Tensor,  # [T, K] int32, -1 = none
        swa_cache: torch.Tensor | None,  # [M, D] window KV rows
        swa_slots: torch.Tensor | None,  # [T, Wn] int32, -1 = none
        sink: torch.Tensor | None,  # [H] fp32 logits
        *,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of every row over exactly the given candidates (+ sink).
        -> (out [T, H, D] in q.dtype, lse [T, H] fp32 base 2, sink folded)."""

    def partial_attention(
        self,
        q: torch.Tensor,
        comp_cache: torch.Tensor,
        comp_slots: torch.Tensor,
        swa_cache: torch.Tensor | None,
        swa_slots: torch.Tensor | None,
        sink: torch.Tensor | None,
        *,
        scale: float,
        rank: int,
        world_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One DCP rank's partial: its owned compressed slots, plus the SWA
        window on rank 0 only and the sink as the declared
        ``Conventions.sink_scheme`` folds it (default: on rank 0 only)."""

    def combine(
        self,
        out: torch.Tensor,  # [T, H, D] partial output, any float dtype
        lse: torch.Tensor,  # [T, H] fp32
        group,
        *,
        backend: str = "ag_rs",
        lse_base: float = 2.0,
        return_lse: bool = False,
    ):
        """LSE-weighted merge across ranks, then keep this rank's heads.
        -> out [T, H_loc, D] (out.dtype), or (out, lse [T, H_loc] fp32 in
        lse_base) when return_lse. W = 1 returns the input unchanged."""

    def fused_combine(
        self,
        out: torch.Tensor,  # [T, H, D] bf16, this rank's partial of every gathered head
        lse: torch.Tensor,  # [T, H] fp32, base 2
        sink: torch.Tensor,  # [H_loc] this rank's sink
        swa_indices: torch.Tensor,  # [T, 1, N] int32, the window rows the step is handed
        swa_lens: torch.Tensor,  # [T] int32
        group,
        *,
        backend: str = "ag_rs",
    ):
        """For a port that fuses its sink gather, kernel call and combine into
        one step (H = W * H_loc, W > 1): that step, its kernel standing in by
        writing ``out`` / ``lse``. -> (out [T, H_loc, D], and what the step
        handed its kernel: sink [H] or None, swa_indices, swa_lens)."""

    def dcp_attention(
        self,
        q_local: torch.Tensor,  # [T, H_loc, D]
        sink_local: torch.Tensor | None,  # [H_loc]
        comp_cache: torch.Tensor,
        comp_slots: torch.Tensor,  # this rank's stage-1 output
        swa_cache: torch.Tensor | None,
        swa_slots: torch.Tensor | None,
        group,
        *,
        scale: float,
        backend: str = "ag_rs",
        token_chunk: int | None = None,
    ) -> torch.Tensor:
        """The whole stage-3 path: gather q and sinks, partial attention,
        combine (then, under the ``after_merge`` sink scheme, the sink folded
        into the merged result); rows processed in sub-chunks of at most ``token_chunk``
        tokens when given. -> [T, H_loc, D]."""

    # ---- stage 9: prefill via compressed-KV gather ----------------------
    def prefill_geometry(self, seq_lens: torch.Tensor, *, rho: int, bs: int, world_size: int):
        """Geometry of one step's prefill requests (``seq_lens`` [R]: their
        lengths in tokens after the step), computed once per step and shared
        by every layer of the KV layout: an object with ``pages`` [R]
        (``max(1, ceil((L // rho) / (bs*W)))``) and ``bases`` [R]
        (``sum_{j<i} W*pages_j``) int64 tensors and ``total_pages`` (int)."""

    def prefill_gather(
        self, comp_cache: torch.Tensor, block_table: torch.Tensor, geometry, group, *, bs: int
    ) -> torch.Tensor:
        """All-gather every prefill request's first ``pages_i`` pages of every
        rank, rank-major per request (request i's pages from rank r start at
        page ``bases[i] + r*pages[i]``): -> [total_pages * bs, D].
        ``block_table`` [R, max_blocks] holds this rank's rows of the prefill
        requests, in the geometry's order."""

    def prefill_remap(
        self,
        topk: torch.Tensor,
        token_to_req: torch.Tensor,
        is_valid_token: torch.Tensor,
        geometry,
        *,
        bs: int,
        world_size: int,
        interleave: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Global ids -> slots of the gathered buffer, in place (-1 stays -1;
        ``token_to_req`` indexes the geometry's requests).
        -> (slots [T, K] int32, counts [T] int32: valid ids; invalid tokens
        get count 0)."""

    # ---- optional answers the harness asks before launch --------------------
    def unavailable_reason(self, terms: CaseTerms) -> str | None:
        """Why this case cannot run here (the test is skipped with it), or None."""

    def known_defect(self, terms: CaseTerms) -> KnownFailure | str | None:
        """A known defect of this implementation that makes this case fail
        (the test becomes an expected failure with it, and still runs), or
        None. A :class:`KnownFailure` also says how the case fails, and a
        failure that does not show it fails the test; a plain string
        explains any failure of the case."""

    def cured(self, cures: tuple[str, ...]):
        """A context manager: inside it this process's implementation runs
        with the causes of the known defects named by ``cures`` (their
        ``KnownFailure.cures``) neutralised, as it would with them fixed.
        Needed only by an implementation that answers cured defects."""

    # ---- the gate ---------------------------------------------------------
    def serving_probes(self) -> dict[str, str | None]:
        """For an implementation built on a serving stack: how that stack
        writes and stores what the port reads, asked of its own code. Probe
        name ("compressed writer", "read side's interleave unit",
        "sliding-window cache placement", "FlashInfer kernel call") -> what
        disagrees, or None."""
        ...

    def build_attention(self, layout, group, **options):
        """Build one layer's DCP attention path for ``layout`` (``rho``: 0 =
        SWA only, ``bs``, ``interleave``, ``world_size``) on ``group``. An
        invalid layout raises ValueError; then, with W > 1 and
        DSV41_DCP_STAGE < 3, NotImplementedError naming the variable and the
        way out, before any forward and any collective. Options the e2e
        tests pass: ``backend`` ("ag_rs" | "a2a"), ``prefill_gather`` (bool;
        None = DSV41_DCP_PREFILL_GATHER=1), ``prefill_token_chunk``, ``stack``
        (a :class:`dcpcheck.scenarios.topology.StackPosition`: the layer's id
        in a DSV4.1 topology, for an implementation that builds layers the
        way the model does; None: a one-layer model), ``max_model_len``
        (vLLM's ``--max-model-len``: no request of the trace is longer; an
        implementation that sizes block tables as vLLM does sizes them for it;
        absent: the implementation's own default).

        The layer returned offers:

        * ``plan_step(*, seq_lens [R], token_to_req [T], positions [T],
          is_valid_token [T], is_prefill_request [R], swa_slots [T, window],
          swa_write_slots [T] | None, block_table [R, max_blocks] | None)``
          -> the step's metadata, built once per step and KV layout and
          given to every layer of that layout;
        * ``forward(plan, *, q [T, H_loc, D], sink [H_loc], swa_cache,
          comp_cache=None, topk [T, K]=None, kv [T, D]=None,
          states [T, D]=None)`` -> [T, H_loc, D]: writes each row's window
          row (kv) and the compressed state its position completes (states,
          through the sharded write path), then attends."""
