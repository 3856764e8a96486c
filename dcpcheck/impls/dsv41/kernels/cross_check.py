"""The reference kernel checked against a real one on the same inputs.

Where a real kernel computes the port's call (:mod:`.selection`), the reference
kernel computes it again into buffers of its own and the two are compared
within the tolerance CONTRACT.md §8.1 derives from the fp8_ds_mla record and
bf16 rounding. Beyond it is a finding against the reference kernel's
contract (:class:`ReferenceKernelFinding`, naming the rows and heads that
differ); it fails the case that made the call, never hidden. Each comparison
is one JSON line in the file ``DCPCHECK_KERNEL_LOG`` names, when set
(``tools/gpu_ci.py`` sets it per session and sums the lines per W).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from dcpcheck.impls.dsv41.kernels import reference

LOG_ENV = "DCPCHECK_KERNEL_LOG"
BF16_UNIT = 2.0**-9  # bf16's unit roundoff (8 significant bits)
FP32_UNIT = 2.0**-24
EXP2_APPROX = 2.0**-22  # ex2.approx.f32's relative error
MARGIN = 4.0  # over the derived bound: the bound sums worst cases, the margin covers the terms it leaves out
SHOWN = 8  # differing (row, head) pairs named in a finding
ROW_BLOCK = 256  # rows compared at a time: the candidates read are [rows, N, 512] fp32


class ReferenceKernelFinding(AssertionError):
    """The reference kernel and a real one disagree beyond the derived tolerance."""


@dataclass(frozen=True)
class Comparison:
    kernel: str
    worst_out: float  # worst |difference| / tolerance of out
    worst_lse: float  # of the LSE
    differing: tuple  # ((row, head, what, real, reference, tolerance), ...), worst first

    @property
    def worst(self) -> float:
        return max(self.worst_out, self.worst_lse)


def tolerances(query, sm_scale, sinks, rows, valid, ref_lse):
    """-> (out tolerance [T, H, D], LSE tolerance [T, H]) of CONTRACT.md §8.1.

    Both kernels read the same record values (e4m3 times a power of two, and
    bf16: exact in fp32). ``out``: the real kernel rounds each probability to
    bf16 before P·V (at most ``u·Σ p|v|``), each kernel its output to bf16
    (``u·|o|`` each, ``|o| <= Σ p|v|``): three bf16 units of the absolute
    attention ``Σ p|v|``. The base-2 LSE: fp32 dot products of D terms, fp32
    sums of the N exponentials (ex2.approx), the final value's rounding."""
    rows = rows.masked_fill(~valid[..., None], 0.0)
    logits = (torch.einsum("thd,tnd->thn", query.float(), rows) * sm_scale).masked_fill(~valid[:, None, :], -math.inf)
    if sinks is not None:
        logits = torch.cat([logits, sinks.float()[None, :, None].expand(logits.shape[0], -1, 1)], dim=2)
    probabilities = torch.softmax(logits, dim=2).nan_to_num(0.0)[..., : rows.shape[1]]  # an empty row: none
    out_tol = MARGIN * 3 * BF16_UNIT * torch.einsum("thn,tnd->thd", probabilities, rows.abs())
    head_dim = query.shape[-1]
    dots = torch.einsum("thd,tnd->thn", query.float().abs(), rows.abs()).amax(dim=2)  # [T, H]
    count = valid.sum(1, keepdim=True).float()
    log2e = 1.0 / math.log(2.0)
    lse_tol = MARGIN * (
        log2e * abs(sm_scale) * head_dim * FP32_UNIT * dots
        + (count + 2) * EXP2_APPROX * log2e
        + FP32_UNIT * ref_lse.abs().nan_to_num(0.0, 0.0, 0.0)
    )
    return out_tol, lse_tol


def compare(kernel, query, sm_scale, sinks, rows, valid, real_out, real_lse, ref_out, ref_lse) -> Comparison:
    """Real vs reference ``out`` [T, H, D] and base-2 ``lse`` [T, H]; rows/valid: the candidates read."""
    out_tol, lse_tol = tolerances(query, sm_scale, sinks, rows, valid, ref_lse)
    tiny = torch.finfo(torch.float32).tiny
    out_diff = (real_out.float() - ref_out.float()).abs().nan_to_num(math.inf, math.inf)
    out_ratio = torch.where(out_diff == 0, 0.0, out_diff / out_tol.clamp_min(tiny)).amax(dim=2)  # [T, H]
    out_err = out_diff.amax(dim=2)
    out_tol = out_tol.amax(dim=2)
    same_inf = torch.isinf(ref_lse) & (real_lse == ref_lse)
    lse_err = torch.where(same_inf, 0.0, (real_lse - ref_lse).abs()).nan_to_num(math.inf, math.inf)
    lse_ratio = torch.where(lse_err == 0, 0.0, lse_err / lse_tol.clamp_min(tiny))
    differing = []
    for what, ratio, real, ref, tol in (
        ("out", out_ratio, out_err, torch.zeros_like(out_err), out_tol),
        ("lse", lse_ratio, real_lse, ref_lse, lse_tol),
    ):
        for row, head in (ratio > 1).nonzero().tolist():
            differing.append(
                (
                    row,
                    head,
                    what,
                    float(real[row, head]),
                    float(ref[row, head]),
                    float(tol[row, head]),
                    float(ratio[row, head]),
                )
            )
    differing.sort(key=lambda item: -item[-1])
    return Comparison(
        kernel,
        float(out_ratio.max()) if out_ratio.numel() else 0.0,
        float(lse_ratio.max()) if lse_ratio.numel() else 0.0,
        tuple(item[:-1] for item in differing),
    )


def finding_message(comparison: Comparison, num_rows: int, num_heads: int) -> str:
    pairs = sorted({(row, head) for row, head, *_ in comparison.differing})
    shown = "; ".join(
        f"row {row} head {head} {what}: {comparison.kernel} {real:.6g}"
        + (f" vs reference {ref:.6g}" if what == "lse" else " differs by that")
        + f" (tolerance {tol:.3g})"
        for row, head, what, real, ref, tol in comparison.differing[:SHOWN]
    )
    return (
        f"the reference kernel's contract disagrees with {comparison.kernel} on {len(pairs)} of "
        f"{num_rows * num_heads} (row, head) pairs, rows {sorted({r for r, _ in pairs})[:SHOWN]}, "
        f"heads {sorted({h for _, h in pairs})[:SHOWN]} (worst out {comparison.worst_out:.3g}, "
        f"LSE {comparison.worst_lse:.3g} of the tolerance, CONTRACT.md §8.1): {shown}"
    )


def log(entry: dict) -> None:
    """One JSON line, with the caller's W, in ``$DCPCHECK_KERNEL_LOG`` (appends of one short line: whole on Linux)."""
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as file:
            file.write(json.dumps({**entry, "W": world_size()}) + "\n")


def world_size() -> int:
    """The W of the rank making the call: its process group's size (1 outside one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _read(block, head_dim, swa_kv_cache, swa_indices, swa_lens, extra_kv_cache, extra_indices, extra_lens):
    """-> (rows [T', N, D], valid [T', N]) the reference kernel reads for the rows of ``block``."""
    rows, valid = reference._candidate_rows(
        swa_kv_cache, swa_indices[block], None if swa_lens is None else swa_lens[block], "swa indices", head_dim
    )
    if extra_indices is not None:
        extra_rows, extra_valid = reference._candidate_rows(
            extra_kv_cache, extra_indices[block], None if extra_lens is None else extra_lens[block],
            "compressed indices", head_dim,
        )  # fmt: skip
        rows, valid = torch.cat([rows, extra_rows], 1), torch.cat([valid, extra_valid], 1)
    return rows, valid


def checked(kernel: str, compute, query, swa_kv_cache, swa_indices, swa_lens, extra_kv_cache, extra_indices,
            extra_lens, out, sm_scale, sinks, lse) -> Comparison:  # fmt: skip
    """``compute`` writes ``out``/``lse``; the reference computes the same call into its own
    buffers; a disagreement beyond the tolerance raises :class:`ReferenceKernelFinding`."""
    compute(query, swa_kv_cache, swa_indices, swa_lens, extra_kv_cache, extra_indices, extra_lens, out, sm_scale,
            sinks, lse)  # fmt: skip
    ref_out, ref_lse = torch.empty_like(out), torch.empty_like(lse)
    reference.sparse_attention_with_lse(query, swa_kv_cache, swa_indices, swa_lens, extra_kv_cache, extra_indices,
                                        extra_lens, ref_out, sm_scale, sinks, ref_lse)  # fmt: skip
    parts = [
        compare(kernel, query[block], sm_scale, sinks, *_read(block, query.shape[-1], swa_kv_cache, swa_indices,
                swa_lens, extra_kv_cache, extra_indices, extra_lens), out[block], lse[block], ref_out[block],
                ref_lse[block])
        for block in (slice(start, start + ROW_BLOCK) for start in range(0, query.shape[0], ROW_BLOCK))
    ]  # fmt: skip
    comparison = Comparison(
        kernel,
        max((part.worst_out for part in parts), default=0.0),
        max((part.worst_lse for part in parts), default=0.0),
        tuple((row + index * ROW_BLOCK, *rest) for index, part in enumerate(parts) for row, *rest in part.differing),
    )
    log(
        {
            "kernel": kernel,
            "rows": int(query.shape[0]),
            "heads": int(query.shape[1]),
            "worst": comparison.worst,
            "differing": len(comparison.differing),
        }
    )
    if comparison.differing:
        raise ReferenceKernelFinding(finding_message(comparison, query.shape[0], query.shape[1]))
    return comparison


def summary_lines(name: str, path) -> list[str]:
    """A session's ``$DCPCHECK_KERNEL_LOG`` as the GPU CI summary's lines: per W, the calls each
    kernel computed and the worst real-vs-reference error over tolerance; why the reference computed."""
    calls: dict = {}
    worst: dict = {}
    reasons: set = set()
    for line in open(path).read().splitlines() if os.path.exists(path) else ():
        entry = json.loads(line)
        key = (entry["W"], entry["kernel"])
        calls[key] = calls.get(key, 0) + 1
        if "worst" in entry:
            worst[key] = max(worst.get(key, 0.0), entry["worst"])
        if "why" in entry:
            reasons.add(entry["why"])
    lines = [
        f"| {name} | {w} | {kernel} | {count} | "
        + (f"{worst[(w, kernel)]:.3g}" if (w, kernel) in worst else "-")
        + " |"
        for (w, kernel), count in sorted(calls.items())
    ]
    return lines + [f"| {name} | | reference because | {why} | |" for why in sorted(reasons)]
