"""Does the SM120 kernel have a specialisation for every shape DeepSeek-V4.1 is served at under DCP?

Asked at start-up, before any case, as a server should at init: each served shape against the
envelope of the FlashInfer release vLLM pins (:mod:`..kernels.kernel_envelope`), and against
vLLM's own init check (``has_flashinfer_sparse_mla_sm120_config``, which the port calls with its
kernel heads and the window width). A shape the kernel has no specialisation for is the finding,
named. Public cases of exactly this: vllm-project/vllm#56837 (no SM120 kernel for 64 heads at top-k
1152, found only by the first forward's warm-up), vllm-project/vllm#50720 (a 5-token MTP decode
routed to the prefill entry on 2x DGX Spark, TP 2).

The served shapes:

* the checkpoints' heads: DeepSeek-V4.1-Flash's 64 (vllm#56837's ``num_heads=64`` at TP 1) and
  DeepSeek-V4.1's 128;
* the users' layouts: TP x DCP on 2 and 4 GPUs (vLLM's DCP ranks are TP ranks: DCP divides TP);
  the kernel's heads are the rank's heads padded by the tree's own ``get_padded_num_q_heads`` at
  DCP 1, and the W ranks' unpadded heads gathered at DCP W (the seed's ``n_dcp_heads``);
* the segments' widths: the window (``_required_sm120_sparse_topk``: what vLLM asks at init) and
  each ``index_topk`` vLLM serves under DCP (:func:`..tree.sources.served_topk_widths`);
* the routes: a decode step of one request is ``1 + k`` flattened rows with ``k`` MTP tokens,
  which the entry sends to its decode kernels (up to their token limit); a batch past that limit,
  and every prefill chunk, goes to its prefill kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

from dcpcheck.impls.dsv41.kernels.kernel_envelope import KernelEnvelope, envelope_of
from dcpcheck.impls.dsv41.tree.loading import PortTree
from dcpcheck.impls.dsv41.tree.sources import served_topk_widths

SERVED_CHECKPOINTS = (("DeepSeek-V4.1-Flash", 64), ("DeepSeek-V4.1", 128))
LAYOUTS = ((2, 2, 1), (2, 2, 2), (4, 4, 1), (4, 4, 2), (4, 4, 4))  # (GPUs, TP, DCP)
SPECULATIVE_TOKENS = (0, 1, 3, 5)  # MTP draft tokens a decode step verifies (vllm#50720 served 5)
WINDOW = 128  # DSV4.1's sliding window: the SWA segment's width, and the top_k vLLM's init check asks


@dataclass(frozen=True)
class ServedShape:
    checkpoint: str
    heads: int
    gpus: int
    tp: int
    dcp: int
    kernel_heads: int
    widths: tuple[int, ...]  # the window, then the compressed segment's index_topk
    q_len: int

    def __str__(self) -> str:
        return (
            f"{self.checkpoint} ({self.heads} heads) on {self.gpus} GPUs at TP {self.tp} x DCP {self.dcp}: "
            f"{self.kernel_heads} kernel heads, segments of {' and '.join(map(str, self.widths))}, q_len {self.q_len}"
        )


def served_shapes(pad_heads) -> list[ServedShape]:
    """Every served shape; ``pad_heads``: the tree's ``get_padded_num_q_heads``."""
    shapes = []
    for checkpoint, heads in SERVED_CHECKPOINTS:
        for gpus, tp, dcp in LAYOUTS:
            local = heads // tp
            kernel_heads = local * dcp if dcp > 1 else pad_heads(local)
            for top_k in served_topk_widths():
                for k in SPECULATIVE_TOKENS:
                    shapes.append(ServedShape(checkpoint, heads, gpus, tp, dcp, kernel_heads, (WINDOW, top_k), 1 + k))
    return shapes


def shape_problems(envelope: KernelEnvelope, shape: ServedShape) -> list[str]:
    """What the kernel lacks for ``shape`` (empty: it has every route it takes)."""
    problems = []
    heads = shape.kernel_heads
    if not envelope.vllm_admits(heads, WINDOW):
        problems.append(f"vLLM refuses it at init (has_flashinfer_sparse_mla_sm120_config({heads}, {WINDOW}))")
    at_init = (
        " (vLLM's init check admits it: it fails at the first forward)" if envelope.vllm_admits(heads, WINDOW) else ""
    )
    for width in shape.widths:
        if not envelope.decode_has(heads, width, shape.q_len):
            problems.append(f"no decode kernel for {heads} heads, top-k {width}, {shape.q_len} tokens{at_init}")
        if not envelope.prefill_has(heads, width):
            problems.append(
                f"no prefill kernel for {heads} heads, top-k {width} (batches past "
                f"{envelope.max_decode_tokens} tokens and prefill chunks route there){at_init}"
            )
    return problems


def kernel_envelope_answer(tree: PortTree) -> tuple[str | None, str]:
    """-> (the finding, or None; the run header's line) for the tree's kernel heads."""
    envelope = envelope_of(tree.flashinfer.sources)
    attention = getattr(tree.module({}), tree.spec.cls)
    found: dict[str, list[ServedShape]] = {}
    shapes = served_shapes(attention.get_padded_num_q_heads)
    for shape in shapes:
        for problem in shape_problems(envelope, shape):
            found.setdefault(problem, []).append(shape)
    version = tree.flashinfer.sources.version
    if not found:
        return None, f"every one of {len(shapes)} served shapes has one in FlashInfer {version} ({envelope.describe()})"
    finding = "; ".join(f"{problem}: {len(met)} served shape(s), first {met[0]}" for problem, met in found.items())
    return f"FlashInfer {version}'s SM120 kernel lacks a specialisation: {finding}", f"FINDING: {finding}"
