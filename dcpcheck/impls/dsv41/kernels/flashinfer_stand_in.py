"""FlashInfer's ``flashinfer.mla._core`` as the port's SM120 wrapper imports it,
with the reference kernel computing where the compiled kernel would.

The seed's ``_sm120_sparse_attention_with_lse`` imports three names from
``flashinfer.mla._core`` when it is called and calls the SM120 entry with them.
Here those names come from the source of the release the tree's vLLM pins
(:mod:`.flashinfer_sources`):

* ``_SparseMLASegment``, ``_check_sm120_dsv4_kv_cache_layout`` and the
  helpers the entry checks its arguments with (``_normalize_sparse_mla_segments``
  and what it calls, ``_normalize_optional_mla_sink``) are FlashInfer's own
  definitions, executed from that file: plain torch, no compiled part;
* ``_trtllm_batch_decode_sparse_mla_sm120`` is the entry's own ``def`` line
  (its parameters and defaults, compiled from that file) over a body of
  dcpcheck's: the checks the entry makes before its kernel (written from its
  source, 0.7.2.post1), then the kernel :mod:`.selection` picks (the reference
  kernel, :func:`.reference.sparse_attention_with_lse`, where no real one runs).
  A missing, extra or misnamed argument raises Python's own ``TypeError``
  at the call, naming the entry, as it would on SM120.

One thing differs from the entry, a scale-down the run header names: the head
dim is the case's (the entry takes 512 or 576; DSV4.1's is 512, run by the GPU
profile), and with it the width of the fp8_ds_mla record the driver's caches
hold (:mod:`.kv_cache_format`; bf16 pages in dcpcheck's bf16 variant).
"""

from __future__ import annotations

import ast
import copy
import inspect
import sys
import types
import typing
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from dcpcheck.impls.dsv41.kernels.flashinfer_sources import FlashInferSources
from dcpcheck.impls.dsv41.kernels.record_formats import check_record_formats
from dcpcheck.impls.dsv41.kernels.selection import KernelSelection

MODULE = "flashinfer.mla._core"
ENTRY = "_trtllm_batch_decode_sparse_mla_sm120"
# FlashInfer's definitions executed as they are: what the seed imports, and
# what the entry runs on its arguments before its kernel.
EXECUTED = (
    "_SparseMLASegment",
    "_NormalizedSparseMLASegment",
    "_check_sm120_dsv4_kv_cache_layout",
    "_sparse_mla_reshape",
    "_normalize_sparse_mla_indices_and_lens",
    "_normalize_sparse_mla_segments",
    "_normalize_optional_mla_sink",
)
# The source's own imports these definitions need (nothing of FlashInfer's).
IMPORTABLE = {"torch", "typing", "dataclasses", "functools", "os"}
# Finding 6 (docs/dsv41.md): the seed omits lse_scale, which the entry requires.
# Outside its probe the call gets the fix's value, so the rest of the call (and
# every later check) still runs: 1.0 keeps the base-2 LSEs the port combines.
FINDING_6_FIX = {"lse_scale": 1.0}


class FlashInferSourceError(ValueError):
    """The pinned source lacks a definition the port's wrapper needs."""


def _definitions(tree: ast.Module, names) -> dict[str, ast.stmt]:
    found = {
        node.name: node
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in set(names)
    }
    missing = [name for name in names if name not in found]
    if missing:
        raise FlashInferSourceError(f"{MODULE} has no {', '.join(missing)}")
    return found


def _source_imports(tree: ast.Module) -> list[ast.stmt]:
    """The file's top-level ``import``/``from`` lines of stdlib typing helpers and torch."""
    kept = []
    for node in tree.body:
        if isinstance(node, ast.Import) and all(alias.name in IMPORTABLE for alias in node.names):
            kept.append(node)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in IMPORTABLE:
            kept.append(node)
    return kept


def _entry_stub(entry: ast.FunctionDef) -> ast.FunctionDef:
    """The entry's ``def`` (decorators dropped) whose body hands its arguments to dcpcheck."""
    stub = copy.copy(entry)
    stub.body = ast.parse("return __dcpcheck_entry__(dict(locals()))").body
    stub.decorator_list, stub.returns = [], None
    return stub


@dataclass
class FlashInferCore:
    """The stand-in module's contents, and how its entry treats the port's call."""

    sources: FlashInferSources
    fixes: dict = field(default_factory=lambda: dict(FINDING_6_FIX))
    # Where the kernel computes: the reference kernel, or a real one where one runs (selection.py).
    selection: KernelSelection = field(default_factory=KernelSelection)

    def __post_init__(self):
        path = self.sources.core
        tree = ast.parse(path.read_text(), filename=str(path))
        definitions = _definitions(tree, (*EXECUTED, ENTRY))
        body = [*_source_imports(tree), *(definitions[name] for name in EXECUTED), _entry_stub(definitions[ENTRY])]
        self.namespace = {"__name__": MODULE, "__dcpcheck_entry__": self._run}
        # dont_inherit: the source is compiled under its own __future__ flags, not this module's.
        code = compile(ast.fix_missing_locations(ast.Module(body, [])), str(path), "exec", dont_inherit=True)
        exec(code, self.namespace)
        self.entry = self.namespace[ENTRY]
        self.signature = inspect.signature(self.entry)
        self.kv_cache_formats = typing.get_args(self.signature.parameters["kv_cache_format"].annotation)
        self.module = types.ModuleType(MODULE, f"dcpcheck's stand-in for {MODULE} ({path})")
        self.module.__dict__.update({name: self.namespace[name] for name in EXECUTED})
        setattr(self.module, ENTRY, self._called)

    def _called(self, *args, **kwargs):
        """The entry, with the fixes of known findings supplied where the port omits exactly those."""
        try:
            given = self.signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return self.entry(*args, **kwargs)  # Python's own error for the call, naming the entry
        missing = [
            name
            for name, parameter in self.signature.parameters.items()
            if parameter.default is parameter.empty and name not in given
        ]
        if missing and set(missing) <= self.fixes.keys():
            kwargs = {**kwargs, **{name: self.fixes[name] for name in missing}}
        return self.entry(*args, **kwargs)

    def _run(self, call: dict):
        """The entry's body: its checks before the kernel (0.7.2.post1), then the reference kernel."""
        query, kv_cache, out, lse = call["query"], call["kv_cache"], call["out"], call["lse"]
        if query.ndim != 4:
            raise ValueError(f"Expected query.ndim == 4, got {query.ndim}")
        for name in ("kv_cache", "workspace_buffer"):
            if call[name].device != query.device:
                raise ValueError(f"{name} must be on query device {query.device}, got {call[name].device}")
        if call["kv_cache_format"] not in self.kv_cache_formats:
            raise ValueError(f"kv_cache_format={call['kv_cache_format']!r}; accepted: {self.kv_cache_formats}")
        if call["backend"] != "sparse":
            raise ValueError(f"backend={call['backend']!r}: dcpcheck models the 'sparse' SM120 route only")
        batch_size, q_len, num_heads, head_dim = query.shape
        if num_heads > 128:
            raise ValueError(f"Expected num_heads <= 128, got {num_heads}")
        segments = self.namespace["_normalize_sparse_mla_segments"](
            sparse_mla_segments=call["sparse_mla_segments"],
            batch_size=batch_size,
            q_len_per_request=q_len,
            device=query.device,
        )
        # The runner reads the record the format arguments name (functional_run's resolve_model_type), not the cache's.
        caches = {"kv_cache": kv_cache}
        caches.update(
            (f"sparse_mla_segments[{i}].kv_cache", segment.kv_cache)
            for i, segment in enumerate(segments)
            if segment.kv_cache is not None
        )
        check_record_formats(call["kv_cache_format"], call["kv_scale_format"], head_dim, caches)
        flat = (batch_size * q_len, num_heads)
        expected_out = (batch_size, q_len, num_heads, head_dim)  # the entry's: head_dim 512
        if out is None:
            out = torch.empty(expected_out, dtype=torch.bfloat16, device=query.device)
        elif tuple(out.shape) != expected_out or out.dtype != torch.bfloat16 or out.device != query.device:
            raise ValueError(f"out must be {expected_out} bf16 on {query.device}, got {tuple(out.shape)} {out.dtype}")
        if call["return_lse"] and lse is not None:
            if tuple(lse.shape) not in (flat, (batch_size, q_len, num_heads)) or lse.dtype != torch.float32:
                raise ValueError(f"lse must have shape {flat} or {(batch_size, q_len, num_heads)} fp32")
        lse_flat = (
            lse.view(flat)
            if call["return_lse"] and lse is not None
            else torch.empty(flat, dtype=torch.float32, device=query.device)
        )
        if flat[0]:
            extra = segments[1] if len(segments) > 1 else None
            self.selection.compute(
                query.reshape(flat + (head_dim,)),
                kv_cache,
                segments[0].indices,
                segments[0].lengths,
                None if extra is None else extra.kv_cache,
                None if extra is None else extra.indices,
                None if extra is None else extra.lengths,
                out.view(flat + (head_dim,)),
                float(call["sm_scale"]),
                self.namespace["_normalize_optional_mla_sink"](call["sinks"], "backend='sparse'"),
                lse_flat,
                entry_call=call,
            )
            # lse_scale multiplies the final base-2 LSEs; the empty-row sentinel is unchanged.
            lse_flat.copy_(torch.where(torch.isinf(lse_flat), lse_flat, lse_flat * float(call["lse_scale"])))
        if call["return_lse"]:
            return out, lse if lse is not None else lse_flat
        return out

    @contextmanager
    def installed(self, *, strict: bool = False):
        """``flashinfer.mla._core`` resolves to this stand-in for the duration (``strict``:
        no fix supplied, as the port's call meets the real entry), then what was there before."""
        names = ("flashinfer", "flashinfer.mla", MODULE)
        saved = {name: sys.modules.get(name) for name in names}
        parents = {name: types.ModuleType(name) for name in names[:2]}
        parents["flashinfer"].mla = parents["flashinfer.mla"]
        parents["flashinfer.mla"]._core = self.module
        fixes, self.fixes = self.fixes, ({} if strict else self.fixes)
        sys.modules.update({**parents, MODULE: self.module})
        try:
            yield self
        finally:
            self.fixes = fixes
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module
