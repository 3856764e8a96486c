"""FlashInfer's public DSV4 entry, ``trtllm_batch_decode_sparse_mla_dsv4``, as the port's DCP1 path
calls it on SM120: vLLM's ``flashinfer_trtllm_batch_decode_sparse_mla_dsv4`` (``utils/flashinfer.py``,
a lazy import of ``flashinfer.decode``'s name, which is ``flashinfer/mla/_core.py``'s).

The entry is its own ``def`` line compiled from the pinned release's ``_core.py`` (its parameters and
defaults: a misnamed argument raises Python's ``TypeError`` naming it), over a body of dcpcheck's
written from that source (0.7.2.post1): the checks the entry makes on the SM120 route
(``_resolve_dsv4_sparse_mla_backend`` picks ``"sparse"`` for ``"auto"``,
``_check_dsv4_kv_cache_format_backend``, the inputs that route refuses), then those of
``_trtllm_batch_decode_sparse_mla_dsv4_sm120`` (query dtype and head counts, each cache's layout and
record, the segments), which then calls the SM120 entry of :class:`.flashinfer_stand_in.FlashInferCore`
as it does: ``lse_scale=1.0``, the ``kv_scale_format`` its ``kv_cache_format`` implies, and there the
segments' checks (int32 indices and lengths of the query's shape) before the kernel. So the DCP1 path
meets every argument check the DCP path meets.

Scaled as the SM120 entry is: the entry's 512 is the query's head dim, its 584-byte record that
record at the query's head dim (:mod:`.record_formats`).
"""

from __future__ import annotations

import ast

import torch

from dcpcheck.impls.dsv41.kernels.flashinfer_stand_in import FlashInferCore, _definitions, _entry_stub
from dcpcheck.impls.dsv41.kernels.record_formats import check_record_formats, dsv4_row_bytes

PUBLIC_ENTRY = "trtllm_batch_decode_sparse_mla_dsv4"
SM120_HEADS = (8, 16, 32, 64, 128)  # _trtllm_batch_decode_sparse_mla_dsv4_sm120's head check (backend="sparse")
KV_CACHE_FORMATS = ("fp8", "nvfp4", "fp8_dsv41", "fp8_dsv41_fp4_ca")  # _core.py _DSV4_KV_CACHE_FORMATS
V41_FORMATS = ("fp8_dsv41", "fp8_dsv41_fp4_ca")  # dispatched with kv_scale_format="ue8m0_g32"
# Inputs of other routes the SM120 route refuses (HCA metadata, trtllm-gen's remap and RopeQuant).
REFUSED_ON_SPARSE = (
    "hca_swa_indices",
    "hca_compressed_block_tables",
    "hca_seq_lens",
    "hca_sparse_indices_format",
    "remapped_sparse_indices_buffer",
    "sparse_indices_are_storage_offsets",
    "dsv4_inv_rope_cos_sin_cache",
    "dsv4_output_scale",
)


class FlashInferDsv4Entry:
    """The public entry's stand-in, calling ``core``'s SM120 entry where FlashInfer's calls its own."""

    def __init__(self, core: FlashInferCore):
        self.core = core
        path = core.sources.core
        definition = _definitions(ast.parse(path.read_text(), filename=str(path)), (PUBLIC_ENTRY,))[PUBLIC_ENTRY]
        # The SM120 entry's namespace: the source's typing imports and FlashInfer's executed definitions.
        namespace = {**core.namespace, "__dcpcheck_entry__": self._run}
        stub = ast.fix_missing_locations(ast.Module([_entry_stub(definition)], []))
        exec(compile(stub, str(path), "exec", dont_inherit=True), namespace)
        self.entry = namespace[PUBLIC_ENTRY]

    def _run(self, call: dict):
        """The SM120 route of the entry (backend "auto" or "sparse"), then ``_trtllm_batch_decode_sparse_mla_dsv4_sm120``."""
        query = call["query"]
        if call["backend"] not in ("auto", "sparse"):
            raise ValueError(f"backend={call['backend']!r}: dcpcheck models the SM120 'sparse' route only")
        if call["kv_cache_format"] not in KV_CACHE_FORMATS:
            raise ValueError(
                f"kv_cache_format must be 'fp8', 'fp8_dsv41', 'fp8_dsv41_fp4_ca', or 'nvfp4', got {call['kv_cache_format']!r}"
            )
        refused = [name for name in REFUSED_ON_SPARSE if call[name] is not None]
        refused += [] if call["hca_is_causal"] else ["hca_is_causal"]
        refused += ["hca_use_persistent"] if call["hca_use_persistent"] else []
        if refused:
            raise ValueError(f"backend='sparse' does not accept {', '.join(refused)}")
        for name in ("bmm1_scale", "bmm2_scale"):
            if isinstance(call[name], torch.Tensor):
                raise ValueError(f"SM120/SM121 DSv4 sparse MLA expects {name} to be a float")
        if call["sparse_indices"] is None:
            raise ValueError("backend='sparse' requires sparse_indices")
        if float(call["bmm2_scale"]) != 1.0:
            raise ValueError("SM120 DSv4 sparse MLA does not support bmm2_scale")
        if query.ndim not in (3, 4):
            raise ValueError(f"Expected query.ndim == 3 or 4, got {query.ndim}")
        num_heads, head_dim = query.shape[-2:]
        if query.dtype != torch.bfloat16:
            raise ValueError(f"SM120 DSv4 sparse MLA only supports BF16 query, got {query.dtype}")
        if num_heads not in SM120_HEADS:
            raise ValueError(f"Expected 8, 16, 32, 64, or 128 query heads for SM120 DSv4 sparse MLA, got {num_heads}")
        if call["swa_topk_lens"] is None:
            raise ValueError("backend='sparse' requires swa_topk_lens")
        check_layout = self.core.namespace["_check_sm120_dsv4_kv_cache_layout"]
        swa_kv_cache = check_layout(call["swa_kv_cache"], call["kv_layout"], "swa_kv_cache")
        extra_indices, extra_lens = call["extra_sparse_indices"], call["extra_sparse_topk_lens"]
        if (extra_indices is None) != (extra_lens is None):
            raise ValueError(
                "extra_sparse_indices and extra_sparse_topk_lens must be provided together for backend='sparse'"
            )
        segment = self.core.namespace["_SparseMLASegment"]
        segments = [segment(indices=call["sparse_indices"], lengths=call["swa_topk_lens"])]
        caches = {"swa_kv_cache": swa_kv_cache}
        if extra_indices is not None:
            if call["compressed_kv_cache"] is None:
                raise ValueError("compressed_kv_cache is required when extra_sparse_indices is provided")
            compressed = check_layout(call["compressed_kv_cache"], call["kv_layout"], "compressed_kv_cache")
            segments.append(segment(indices=extra_indices, lengths=extra_lens, kv_cache=compressed))
            caches["compressed_kv_cache"] = compressed
        kv_scale_format = "ue8m0_g32" if call["kv_cache_format"] in V41_FORMATS else "auto"
        # The packed row width each format implies, and the bf16 rows' head dim (the entry's 512).
        for name, cache in caches.items():
            if (
                cache.dtype == torch.uint8
                and call["kv_cache_format"] == "fp8"
                and cache.size(-1) != dsv4_row_bytes(head_dim)
            ):
                raise ValueError(
                    f"Expected packed SM120 fp8 {name} head dim {dsv4_row_bytes(head_dim)}, got {cache.size(-1)}"
                )
            if cache.dtype not in (torch.uint8, query.dtype):
                raise ValueError(f"{name} dtype must match query dtype, got {cache.dtype} and {query.dtype}")
        check_record_formats(call["kv_cache_format"], kv_scale_format, head_dim, caches)
        out = call["out"]
        result = self.core.entry(
            query=query if query.ndim == 4 else query.unsqueeze(1),
            kv_cache=swa_kv_cache,
            workspace_buffer=call["workspace_buffer"],
            sparse_mla_segments=segments,
            out=out if out is None or out.ndim == 4 else out.unsqueeze(1),
            sm_scale=float(call["bmm1_scale"]),
            sinks=call["sinks"],
            lse=None,
            return_lse=False,
            lse_scale=1.0,
            kv_scale_format=kv_scale_format,
            kv_cache_format=call["kv_cache_format"],
            backend="sparse",
        )
        return result.squeeze(1) if query.ndim == 3 else result
