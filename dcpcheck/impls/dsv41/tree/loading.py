"""Load the DCP2 port from a vLLM tree, as a fresh process would import it.

The port reads its switches (``DSV41_DCP_PREFILL_GATHER``) when its module is
imported, so each distinct environment gets its own module object executed
from the tree's file: what a server started with that environment runs.
The port's SM120 wrapper (``_sm120_sparse_attention_with_lse``) runs as it is,
over FlashInfer's ``flashinfer.mla._core`` from the pinned release's source
(:mod:`.flashinfer_stand_in`: the entry's real signature and checks, then the
kernel :mod:`.selection` picks: FlashMLA on SM90/SM100, FlashInfer's own on
SM120, at head dim 512 over the 584-byte record; the reference kernel
elsewhere and at the case's scaled-down record); the DCP1 path's kernel name
is FlashInfer's public DSV4 entry from the same source (:mod:`.flashinfer_dsv4_entry`:
its signature and its SM120 route's checks, into that SM120 entry), so both
paths meet FlashInfer's argument checks and the same choice;
everything else is the tree's code.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from dcpcheck.impls.dsv41.kernels.flashinfer_dsv4_entry import PUBLIC_ENTRY, FlashInferDsv4Entry
from dcpcheck.impls.dsv41.kernels.flashinfer_sources import FlashInferSourcesError, pinned_sources
from dcpcheck.impls.dsv41.kernels.flashinfer_stand_in import ENTRY, FlashInferCore, FlashInferSourceError
from dcpcheck.impls.dsv41.server.kv_cache_format import FP8_DS_MLA, KV_CACHE_DTYPES
from dcpcheck.spies import environments

DEFAULT_MODULE = "vllm.models.deepseek_v41.nvidia.flashinfer_sparse"
DEFAULT_CLASS = "DeepseekV4FlashInferSM120Attention"
BUILDER_CLASS = "DeepseekV4FlashInferSparseMLAMetadataBuilder"

# What the DCP2 diff adds to the attention class; a tree without one of them
# has not been ported.
PORT_METHODS = (
    "_compressed_topk_to_slots",
    "_dcp_prefill_gather",
    "_dcp_attn_sink",
    "_dcp_neutral_swa",
    "_run_sm120_dcp",
    "_forward_decode",
    "_forward_prefill",
    "_forward_sparse_impl",
    "forward_mqa",
)
# Module-level names the layer reaches for its kernels and its DCP group.
SM120_WRAPPER = "_sm120_sparse_attention_with_lse"  # the seed's DCP path into FlashInfer's SM120 entry
DCP1_KERNEL = "flashinfer_trtllm_batch_decode_sparse_mla_dsv4"
KERNEL_NAMES = (SM120_WRAPPER, DCP1_KERNEL)
ENV_READ_AT_IMPORT = ("DSV41_DCP_PREFILL_GATHER",)

INSTALL_HINT = (
    "install vLLM on CPU with tools/install_vllm_cpu.sh, and put your DCP2-ported tree first on "
    "PYTHONPATH (tools/build_dsv41_tree.sh builds one from vLLM 0.33.0 and the seed diff)"
)


class PortSpecError(ValueError):
    """The tree or the class named by ``--dcp-impl dsv41[...]`` is not a DCP2 port."""


@dataclass(frozen=True)
class PortSpec:
    module: str = DEFAULT_MODULE
    cls: str = DEFAULT_CLASS
    # The caches the driver writes: the layer's default fp8_ds_mla, or dcpcheck's bf16 variant.
    kv_cache_dtype: str = FP8_DS_MLA

    @classmethod
    def parse(cls, spec: str) -> PortSpec:
        """``dsv41[:MODULE:CLASS][@KV_CACHE_DTYPE]``, KV_CACHE_DTYPE one of :data:`KV_CACHE_DTYPES`."""
        accepted = (
            "accepted 'dsv41' or 'dsv41:MODULE:CLASS', optionally followed by '@KV_CACHE_DTYPE', one of "
            + ", ".join(KV_CACHE_DTYPES)
        )
        name, at, kv_cache_dtype = spec.partition("@")
        if at and kv_cache_dtype not in KV_CACHE_DTYPES:
            raise PortSpecError(f"--dcp-impl {spec!r}: {accepted}")
        kv_cache_dtype = kv_cache_dtype or FP8_DS_MLA
        if name == "dsv41":
            return cls(kv_cache_dtype=kv_cache_dtype)
        parts = name.split(":")
        if len(parts) != 3 or parts[0] != "dsv41" or not all(parts[1:]):
            raise PortSpecError(f"--dcp-impl {spec!r}: {accepted}")
        return cls(parts[1], parts[2], kv_cache_dtype)


def _file_of(module_name: str) -> str:
    try:
        spec = importlib.util.find_spec(module_name)
    except Exception as exc:  # a parent package missing a dependency, or raising at import
        raise PortSpecError(
            f"cannot find module {module_name!r} ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
        ) from exc
    if spec is None or not spec.origin:
        raise PortSpecError(f"cannot find module {module_name!r}; {INSTALL_HINT}")
    return spec.origin


def _execute(module_name: str, environ: dict[str, str]) -> types.ModuleType:
    """The module executed afresh from its file under ``environ`` (restored after)."""
    path = _file_of(module_name)
    private = f"dcpcheck_dsv41_{abs(hash((path, tuple(sorted(environ.items())))))}"
    spec = importlib.util.spec_from_file_location(private, path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = module_name.rpartition(".")[0]
    try:
        with environments(environ):
            sys.modules[private] = module
            spec.loader.exec_module(module)
    except ImportError as exc:
        sys.modules.pop(private, None)
        raise PortSpecError(
            f"{path} does not import: {exc}. A DCP2 port needs the companion changes the diff relies on "
            f"(docs/dsv41.md, 'How dcpcheck models the server'); {INSTALL_HINT}"
        ) from exc
    except Exception as exc:  # a module it imports raising (e.g. a compiled op called at import)
        sys.modules.pop(private, None)
        raise PortSpecError(
            f"importing {module_name} ({path}) raised {type(exc).__name__}: {exc}; {INSTALL_HINT}"
        ) from exc
    return module


class PortTree:
    """The port's module and class, one module object per import-time environment."""

    def __init__(self, spec: PortSpec):
        self.spec = spec
        self._modules: dict[tuple, types.ModuleType] = {}
        module = self.module({})
        attention = getattr(module, spec.cls, None)
        if attention is None:
            raise PortSpecError(f"{spec.module} has no class {spec.cls!r}")
        missing = [name for name in PORT_METHODS if not callable(getattr(attention, name, None))]
        if not hasattr(module, BUILDER_CLASS):
            missing.append(f"{BUILDER_CLASS} (the metadata builder holding the stage gate)")
        missing += [f"module-level {name}" for name in KERNEL_NAMES if not hasattr(module, name)]
        if missing:
            raise PortSpecError(
                f"{spec.module}.{spec.cls} is not a DCP2 port: it lacks {', '.join(missing)}. "
                f"Apply the DCP2 diff to this tree (README, 'Check your DCP2 port')"
            )
        # After the tree's own checks: a tree that is not a port is told so first.
        try:
            self.flashinfer = FlashInferCore(pinned_sources())
            self.dcp1_entry = FlashInferDsv4Entry(self.flashinfer)
        except (FlashInferSourcesError, FlashInferSourceError, SyntaxError) as exc:
            raise PortSpecError(f"FlashInfer's SM120 entry cannot stand in for the port's kernel call: {exc}") from exc

    @property
    def kernel(self) -> str:
        """Which kernel runs; asked when the header is written, not at load (the
        reason reads the GPU's capability, which initialises CUDA: a zygote that
        loaded the tree could no longer fork ranks that use the GPU)."""
        return (
            f"the port's {SM120_WRAPPER} runs, into FlashInfer {self.flashinfer.sources.version}'s "
            f"{ENTRY} (its signature and argument checks, from {self.flashinfer.sources.core}) "
            f"computing: {self.flashinfer.selection.describe()}; the DCP1 path's {DCP1_KERNEL}: FlashInfer's "
            f"{PUBLIC_ENTRY} (its signature and SM120 route's checks, from the same file) into that entry"
        )

    def module(self, environ: dict[str, str]) -> types.ModuleType:
        """The port module as imported under ``environ`` (only the variables it reads at import)."""
        key = tuple(sorted((k, v) for k, v in environ.items() if k in ENV_READ_AT_IMPORT))
        module = self._modules.get(key)
        if module is None:
            module = _execute(self.spec.module, dict(key))
            wrapper = getattr(module, SM120_WRAPPER, None)
            if callable(wrapper):
                setattr(module, SM120_WRAPPER, self._over_flashinfer(wrapper))
            setattr(module, DCP1_KERNEL, self._dcp1_kernel)
            self._modules[key] = module
        return module

    def _dcp1_kernel(self, *args, **kwargs):
        """FlashInfer's public DSV4 entry, looked up per call: the module is loaded before the entry is built."""
        return self.dcp1_entry.entry(*args, **kwargs)

    def _over_flashinfer(self, wrapper):
        """The port's wrapper, run with FlashInfer's ``flashinfer.mla._core`` standing in for the call;
        ``__wrapped__`` is the wrapper itself (finding 6's probe calls it strictly)."""

        @functools.wraps(wrapper)
        def call(*args, **kwargs):
            with self.flashinfer.installed():
                return wrapper(*args, **kwargs)

        return call


@contextmanager
def patched(target, **replacements):
    """Attributes of ``target`` replaced for the duration, then restored."""
    saved = {name: getattr(target, name) for name in replacements}
    for name, value in replacements.items():
        setattr(target, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(target, name, value)


@contextmanager
def cuda_query_stand_ins():
    """On a torch without CUDA, ``torch.cuda.is_current_stream_capturing`` raises
    instead of answering; the port asks it every call. Answer False there."""
    if torch.cuda.is_available():
        yield
        return
    with patched(torch.cuda, is_current_stream_capturing=lambda: False):
        yield
