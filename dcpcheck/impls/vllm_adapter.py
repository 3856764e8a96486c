"""An installed vLLM tree as the implementation under test (``--dcp-impl vllm``).

Each capability calls vLLM's own function (vLLM 0.33.0 paths):

=============  ==============================================================
filter_index   ``v1.attention.backends.mla.sparse_utils``
               ``.triton_filter_and_convert_dcp_index``
slot_mapping   ``v1.worker.block_table._COMPUTE_SLOT_MAPPING_KERNEL`` (token
               slots, what ``BlockTable.compute_slot_mapping`` launches), then
               ``v1.attention.backends.mla.compressor_utils``
               ``.get_compressed_slot_mapping`` (the state written per token)
gather_heads   ``v1.attention.ops.dcp.MLADCPManager._gather_query``
combine        ``v1.attention.ops.dcp.cp_lse_ag_out_rs`` (backend ``ag_rs``),
               ``v1.attention.ops.dcp.dcp_a2a_lse_reduce`` (backend ``a2a``)
=============  ==============================================================

vLLM has no CPU-runnable counterpart of the other capabilities (sparse and
partial attention with window and sink, the stage-9 gather geometry, the
``DSV41_DCP_STAGE`` gate), so they are not defined and their tests skip.

vLLM is imported when the adapter is constructed, never at module import:
``tools/install_vllm_cpu.sh`` installs it into a CPU venv.

``KNOWN_DEFECTS`` lists, per vLLM release, the defects that make suite checks
fail, each keyed on the contract's terms of a case (capability, W, backend,
LSE base, dtype, scenario properties: :class:`CaseTerms`); the harness runs
those cases as expected failures (docs/vllm.md).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from dcpcheck.impls.protocol import COMBINE_BACKENDS, LSE_BASES, CaseTerms, KnownFailure
from dcpcheck.impls.vllm_stand_ins import install_stand_ins
from dcpcheck.port.triton_env import ensure_triton_mode

INSTALL_HINT = "install it with: tools/install_vllm_cpu.sh <venv>"

# vLLM's default column tile of the index remap kernel; its wrapper asserts
# K % BLOCK_N == 0.
_VLLM_REMAP_TILE = 128


class CapabilityUnavailable(RuntimeError):
    """A capability the implementation has cannot run this case here.

    Raised before any collective and identically on every rank (it depends
    only on the case and the process environment), so a test that did not
    pass the parameters the reason depends on fails with the reason instead
    of a Triton compile error. The same reasons are offered before launch by
    :meth:`VllmImplementation.unavailable_reason`, which turns them into skips.
    """


@dataclass(frozen=True)
class KnownDefect:
    """A vLLM defect in ``capability``: every case that calls it and whose
    terms ``applies`` accepts fails, and no other case does."""

    name: str  # how other implementations built on vLLM's functions refer to it
    capability: str
    applies: Callable[[CaseTerms], bool]
    reason: str  # one line; the cause, with vLLM's files and lines, is in docs/vllm.md
    shows: str  # a regular expression: the failure text of a case this defect fails


# (W, LSE base) where the fp32 rounding of defect 4 moves a weight of the
# LSE -150 + 0.5*r row by 4e-6 to 6e-6 relative (over the fp32 tolerance);
# at the other (W, base) it stays within 2.1e-6. No seed changes it.
_FP32_LSE_ROUNDING_CASES = frozenset({(2, 2.0), (4, 2.0), (8, 2.0), (8, math.e)})

# vLLM release -> its defects.
KNOWN_DEFECTS: dict[str, tuple[KnownDefect, ...]] = {
    "0.33.0": (
        KnownDefect(
            name="short_table_write",
            capability="slot_mapping",
            applies=lambda terms: "short_table" in terms.properties,
            reason="the write side gives a slot to a state whose page is cut from a short block-table row, "
            "which the read side drops (docs/vllm.md, known defect 1)",
            shows=r"slot_mapping (on rank \d+ )?vs the oracle: \d+ problem",
        ),
        KnownDefect(
            name="ag_rs_single_rank",
            capability="combine",
            applies=lambda terms: terms.world_size == 1 and terms.backend == "ag_rs",
            reason="cp_lse_ag_out_rs crashes at W=1: too many values to unpack (docs/vllm.md, known defect 2)",
            shows=r"ValueError: too many values to unpack",
        ),
        KnownDefect(
            name="finite_empty_band",
            capability="combine",
            applies=lambda terms: terms.world_size > 1 and "garbage_under_sentinel" in terms.properties,
            reason="the combine kernels give finite empty-band LSEs (-1e30, -1e29, -FLT_MAX) weight, so the "
            "garbage under them is summed (docs/vllm.md, known defect 3)",
            shows=r"combined output, garbage under the sentinel, vs oracle merge",
        ),
        KnownDefect(
            name="fp32_rounded_lse",
            capability="combine",
            applies=lambda terms: (
                terms.dtype == torch.float32
                and "lse_near_150" in terms.properties
                and (terms.world_size, terms.lse_base) in _FP32_LSE_ROUNDING_CASES
            ),
            reason="the fp32 weights use the merged LSE after it is rounded to fp32, up to 6e-6 off "
            "at |LSE| ~ 150 (docs/vllm.md, known defect 4)",
            shows=r"combined output vs oracle merge \([^()]*dtype=fp32",
        ),
        KnownDefect(
            name="ag_rs_16bit_rescale",
            capability="combine",
            applies=lambda terms: (
                terms.world_size > 1 and terms.backend == "ag_rs" and "rounded_once" in terms.properties
            ),
            reason="cp_lse_ag_out_rs stores each rank's rescaled partial in the 16-bit output dtype and "
            "reduce-scatters it in that dtype: 70 to 460 times one rounding's error (docs/vllm.md, known defect 5)",
            shows=r"combined output vs oracle merge, rounded once",
        ),
        KnownDefect(
            name="ag_rs_16bit_sum",
            capability="combine",
            # Only compiled kernels run ag_rs at W > 1 (unavailable_reason), as a case's backend or as
            # the cross-check of an a2a case. Drawn 16-bit partials stay where no 16-bit sum can fail.
            applies=lambda terms: (
                terms.device == "cuda" and terms.world_size > 1 and "cancelling_terms" in terms.properties
            ),
            reason="cp_lse_ag_out_rs sums the rescaled 16-bit partials in 16 bits: on partials whose terms "
            "cancel it returns 0 where the merge is 7/4 ulp(1), 1.7 times the coarse 16-bit output tolerance "
            "(docs/vllm.md, known defect 5)",
            shows=r"(?:combined output vs oracle merge|ag_rs vs a2a output) \(",
        ),
    ),
}


class VllmImplementation:
    name = "vllm"

    def __init__(self):
        ensure_triton_mode()
        if os.environ.get("TRITON_INTERPRET") == "1":
            # Without an active GPU driver vLLM replaces triton by a do-nothing
            # placeholder unless CUDA_VISIBLE_DEVICES is set and empty
            # (vllm/triton_utils/importing.py); the interpreter needs the real one.
            os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
        try:
            import vllm

            # Before any vLLM module reaches for a compiled extension (on CUDA, at import).
            self.stand_ins = install_stand_ins()
            from vllm.triton_utils import HAS_TRITON
            from vllm.v1.attention.backends.mla import compressor_utils, sparse_utils
            from vllm.v1.attention.ops import dcp
            from vllm.v1.worker import block_table
        except ImportError as exc:
            missing = f"module {exc.name!r} is missing" if exc.name else str(exc)
            raise ImportError(
                f"--dcp-impl vllm: cannot import vLLM's DCP modules: {missing}; {INSTALL_HINT}",
                name=exc.name,
            ) from exc
        except Exception as exc:  # a vLLM module raising at import (e.g. a compiled op it calls)
            raise ImportError(
                f"--dcp-impl vllm: importing vLLM's DCP modules raised {type(exc).__name__}: {exc}; {INSTALL_HINT}"
            ) from exc
        if not HAS_TRITON:
            raise RuntimeError(
                "--dcp-impl vllm: vLLM disabled triton in this process (no active "
                "GPU driver and CUDA_VISIBLE_DEVICES is not empty); on a CPU host "
                "run with CUDA_VISIBLE_DEVICES= and TRITON_INTERPRET=1"
            )
        self.version = vllm.__version__
        self._filter = sparse_utils.triton_filter_and_convert_dcp_index
        self._token_slot_kernel = block_table._COMPUTE_SLOT_MAPPING_KERNEL
        self._compressed_slots = compressor_utils.get_compressed_slot_mapping
        self._gather_query = dcp.MLADCPManager._gather_query
        self._combine_by_backend = {"ag_rs": dcp.cp_lse_ag_out_rs, "a2a": dcp.dcp_a2a_lse_reduce}
        self._ag_rs_correction_kernel = dcp._CORRECT_ATTN_CP_OUT_KERNEL

    def describe(self) -> str:
        """The run header's line: the release, and every stand-in for a compiled extension."""
        return " | ".join((f"vllm {self.version}", *self.stand_ins))

    # ---- stage 1 -----------------------------------------------------------
    def filter_index(self, topk, token_to_req, block_table, is_valid_token, *, bs, world_size, rank, interleave):
        num_topk = topk.shape[1]
        # vLLM takes no validity mask; a padding row with no ids is how it
        # sees one, and its kernel gives such a row count 0.
        topk = topk.masked_fill(~is_valid_token.bool()[:, None], -1)
        return self._filter(
            token_to_req,
            block_table,
            topk,
            dcp_size=world_size,
            dcp_rank=rank,
            # The read side indexes states, so vLLM passes the interleave in
            # states here (indexer.py: compressed_cp_interleave_size).
            cp_kv_cache_interleave_size=interleave,
            BLOCK_SIZE=bs,
            NUM_TOPK_TOKENS=num_topk,
            # Only feeds the K % BLOCK_N assert: with counts, rows up to 4096
            # wide run as one tile. gcd keeps vLLM's 128 whenever K allows it.
            BLOCK_N=math.gcd(num_topk, _VLLM_REMAP_TILE),
            return_valid_counts=True,
        )

    def slot_mapping(self, positions, token_to_req, block_table, *, rho, bs, world_size, rank, interleave):
        device = positions.device
        # vLLM's interleave counts tokens and a state lives on the rank owning
        # its last token, so S states are S * rho tokens.
        token_interleave = interleave * rho
        runs, rows, token_slots = self._run_token_slots(
            positions, token_to_req, block_table, bs * rho, world_size, rank, token_interleave
        )
        run_slots = self._compressed_slots(
            runs.num_tokens,
            token_slots,
            runs.bounds.to(torch.int32).to(device),
            runs.seq_lens.to(torch.int32).to(device),
            rows,
            bs,
            rho,
            dcp_world_size=world_size,
            cp_interleave=token_interleave,
        )
        # vLLM marks padding by its slot (PAD_SLOT_ID), not its position: a
        # position the suite gives as -1 (a padding row) is written nowhere.
        return torch.where(positions < 0, -1, run_slots[runs.index_of_asked.to(device)])

    def token_slots(self, positions, token_to_req, block_table, *, tokens_per_page, world_size, rank, token_interleave):
        """vLLM's DCP token slot mapping (``v1/worker/block_table.py``) of the
        asked (request, position) rows: -1 where another rank owns the token."""
        runs, _, slots = self._run_token_slots(
            positions, token_to_req, block_table, tokens_per_page, world_size, rank, token_interleave
        )
        return torch.where(positions < 0, -1, slots[runs.index_of_asked.to(positions.device)])

    def _run_token_slots(self, positions, token_to_req, block_table, tokens_per_page, world_size, rank, interleave):
        device = positions.device
        runs = _PositionRuns(positions, token_to_req)
        rows = _widened_rows(block_table[runs.requests.to(device)], runs.seq_lens, tokens_per_page * world_size)
        token_slots = torch.empty(runs.num_tokens, dtype=torch.int64, device=device)
        self._token_slot_kernel(
            runs.requests.numel(),  # num_reqs
            runs.num_tokens,
            runs.num_tokens,  # max_num_tokens: no CUDA-graph padding to fill
            runs.bounds.to(torch.int32).to(device),
            runs.positions.to(device),
            rows,
            rows.stride(0),
            token_slots,
            tokens_per_page,
            world_size,
            rank,
            interleave,
        )
        return runs, rows, token_slots

    # ---- stage 3 -----------------------------------------------------------
    def gather_heads(self, x, group, *, dim=1):
        # vLLM gathers q over dim 1 of [T, H_loc, D]; any other head dim is
        # viewed as dim 1 of a 3-D tensor, which keeps the TP order.
        dim %= x.dim()
        shape = tuple(x.shape)
        as_3d = x.reshape(math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :]))
        vllm_manager = SimpleNamespace(group=group, padded_num_heads=None)
        gathered = self._gather_query(vllm_manager, as_3d)
        return gathered.reshape(shape[:dim] + (gathered.shape[1],) + shape[dim + 1 :])

    def combine(self, out, lse, group, *, backend="ag_rs", lse_base=2.0, return_lse=False):
        if backend not in COMBINE_BACKENDS:
            raise ValueError(f"combine backend {backend!r}; accepted: {', '.join(COMBINE_BACKENDS)}")
        if lse_base not in LSE_BASES:
            raise ValueError(f"combine lse_base={lse_base!r}; accepted: 2.0 or math.e")
        num_heads, world_size = out.shape[1], group.world_size
        if num_heads % world_size:
            raise ValueError(
                f"combine: H={num_heads} heads do not split over W={world_size} ranks; accepted: H a multiple of W"
            )
        if world_size > 1:
            reason = self._combine_unavailable_reason(backend, head_dim=out.shape[2])
            if reason:
                raise CapabilityUnavailable(reason)
            if backend == "ag_rs":
                # cp_lse_ag_out_rs rescales the partial output in place.
                out = out.clone()
        return self._combine_by_backend[backend](
            out,
            lse,
            group,
            return_lse=return_lse,
            is_lse_base_on_e=lse_base == math.e,
        )

    # ---- what cannot run here, and what fails ---------------------------------
    def unavailable_reason(self, terms: CaseTerms):
        """Why a case cannot run here (None: it can): a combine backend at
        W > 1 that vLLM's kernels cannot run under this Triton, or at this D."""
        if terms.world_size > 1 and terms.backend in COMBINE_BACKENDS:
            return self._combine_unavailable_reason(terms.backend, head_dim=terms.head_dim)
        return None

    def _combine_unavailable_reason(self, backend, *, head_dim):
        if head_dim is not None and head_dim & (head_dim - 1):
            return (
                f"vLLM's combine kernels take the head dim as a tl.arange bound, which "
                f"Triton requires to be a power of two: D={head_dim} (vllm "
                f"v1/attention/ops/dcp.py, HEAD_DIM)"
            )
        if backend == "ag_rs" and not hasattr(self._ag_rs_correction_kernel.kernel, "constexprs"):
            return (
                "vLLM's cp_lse_ag_out_rs cannot run under the Triton interpreter: its "
                "launcher CorrectAttnCPOutKernel.__call__ (vllm v1/attention/ops/dcp.py) "
                "reads kernel.constexprs, an attribute of triton's JITFunction that the "
                "interpreter's InterpretedFunction (TRITON_INTERPRET=1) lacks; run it on a GPU"
            )
        return None

    def known_defect(self, terms: CaseTerms):
        """The known defects of this vLLM release that make this case fail,
        joined; None when none applies (or the release is not in
        ``KNOWN_DEFECTS``)."""
        found = KnownFailure.joined(KnownFailure(d.reason, d.shows) for d in self.matching_defects(terms))
        return KnownFailure(f"vllm {self.version}: {found.reason}", found.shows) if found else None

    def matching_defects(self, terms: CaseTerms) -> list[KnownDefect]:
        """The known defects of this vLLM release that make this case fail."""
        return [
            defect
            for defect in KNOWN_DEFECTS.get(self.version, ())
            if defect.capability in terms.capabilities and defect.applies(terms)
        ]


class _PositionRuns:
    """The asked (request, position) pairs as vLLM's slot-mapping input.

    vLLM maps runs of consecutive positions, each a request's newest tokens
    (positions seq_len - query_len .. seq_len - 1). Nearby asked positions of
    a request share one run; a run stays within one vector step of vLLM's slot
    kernels, so filling a gap never costs more than a run of its own would.
    """

    MAX_RUN_LEN = 1024  # TRITON_BLOCK_SIZE of vLLM's two slot-mapping kernels

    def __init__(self, positions: torch.Tensor, token_to_req: torch.Tensor):
        asked = list(zip(token_to_req.tolist(), positions.tolist()))
        runs: list[tuple[int, int]] = []  # (request, first position)
        last_positions: list[int] = []
        run_of_pair: dict[tuple[int, int], int] = {}
        for request, position in sorted(set(asked)):
            if runs and runs[-1][0] == request and position - runs[-1][1] < self.MAX_RUN_LEN:
                last_positions[-1] = position
            else:
                runs.append((request, position))
                last_positions.append(position)
            run_of_pair[request, position] = len(runs) - 1
        table = torch.tensor(runs, dtype=torch.int64).reshape(-1, 2)
        self.requests, first = table[:, 0], table[:, 1]
        self.seq_lens = torch.tensor(last_positions, dtype=torch.int64) + 1
        lens = self.seq_lens - first
        self.bounds = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0))
        self.num_tokens = int(self.bounds[-1])
        starts = self.bounds[:-1]
        self.positions = torch.arange(self.num_tokens) + torch.repeat_interleave(first - starts, lens)
        run = torch.tensor([run_of_pair[pair] for pair in asked], dtype=torch.int64)
        self.index_of_asked = starts[run] + positions.cpu() - first[run]


def _widened_rows(rows, seq_lens, tokens_per_virtual_page):
    """Block table rows widened to cover every position of their runs.

    vLLM's write kernels do not bound the page index: its block tables span
    max_model_len and hold 0 (the null block) past a request's pages. A
    narrower table is widened the same way instead of being read past its end.
    """
    if seq_lens.numel():
        pages = (int(seq_lens.max()) - 1) // tokens_per_virtual_page + 1
        if pages > rows.shape[1]:
            rows = torch.nn.functional.pad(rows, (0, pages - rows.shape[1]), value=0)
    return rows.contiguous()
