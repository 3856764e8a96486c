"""Which kernel computes the port's sparse-MLA call, and why (the run header's ``kernel:``).

Per call, after FlashInfer's signature and argument checks (:mod:`.flashinfer_stand_in`):

* SM120/121 with FlashInfer installed, at the production shapes (head dim 512,
  the 584-byte record): FlashInfer's own ``_trtllm_batch_decode_sparse_mla_sm120``
  computes the entry's call as the port made it (``lse_scale`` 1: the stand-in
  applies the call's own after, as for every kernel);
* SM90/SM100 with FlashMLA installed (``sgl-flash-mla``, ``tools/carry_flashmla.py``),
  at the production shapes: FlashMLA's sparse decode through :mod:`.flashmla`;
* anywhere else, and at the CPU profile's scaled-down records (80-89 bytes a
  token, which neither real kernel reads): the reference kernel.

A call a real kernel computes is computed by the reference kernel too and
compared (:mod:`.cross_check`). The DCP1 path's kernel name
(``flashinfer_trtllm_batch_decode_sparse_mla_dsv4``) reaches the same entry
through FlashInfer's public DSV4 entry (:mod:`.flashinfer_dsv4_entry`), so
it gets the same choice.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dcpcheck.impls.dsv41.kernels import cross_check, flashmla, reference

FLASHMLA = "FlashMLA"
FLASHINFER_SM120 = "FlashInfer SM120"
REFERENCE = "reference"
FLASHMLA_ARCHS = (9, 10)  # SM90, SM100: vLLM 0.33.0 serves DSV4.1 with FlashMLA there
SM120_ARCH = 12  # SM120 and SM121 (GB10)
FLASHINFER_MODULE = "flashinfer.mla._core"


def _capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def _import_flash_mla():
    return importlib.import_module("flash_mla")


def _import_sm120_entry():
    return importlib.import_module(FLASHINFER_MODULE)._trtllm_batch_decode_sparse_mla_sm120


def installed_version(distribution: str) -> str | None:
    """Its version where it is installed (found without importing it: no CUDA initialised)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


@dataclass
class KernelSelection:
    """The per-call choice; the loaders and the capability are the tests' seams."""

    capability: Callable = _capability
    load_flash_mla: Callable = _import_flash_mla
    load_sm120_entry: Callable = _import_sm120_entry
    _loaded: dict = field(default_factory=dict)  # name -> (module or entry, None) or (None, why not)
    last: cross_check.Comparison | None = None  # the last call's comparison (None: the reference computed it)

    def _load(self, name: str, loader: Callable):
        if name not in self._loaded:
            try:
                self._loaded[name] = (loader(), None)
            except (ImportError, OSError, RuntimeError, AttributeError) as exc:  # not installed, or does not load here
                self._loaded[name] = (None, f"{type(exc).__name__}: {exc}")
        return self._loaded[name]

    def choose(self, query, swa_kv_cache, compressed_kv_cache, entry_call) -> tuple[str, object, str]:
        """-> (kernel, its module or entry, why) for one call."""
        capability = self.capability(query.device)
        if capability is None:
            return REFERENCE, None, "no GPU"
        arch = f"SM{capability[0]}{capability[1]}"
        shapes = flashmla.applies(query, swa_kv_cache, compressed_kv_cache)
        if capability[0] == SM120_ARCH:
            if entry_call is None:
                return (
                    REFERENCE,
                    None,
                    f"{arch}: a call not made through the SM120 entry",
                )
            if shapes:
                return REFERENCE, None, f"{arch}: {shapes}"
            entry, why_not = self._load(FLASHINFER_SM120, self.load_sm120_entry)
            if entry is None:
                return REFERENCE, None, f"{arch}: FlashInfer does not import ({why_not})"
            return FLASHINFER_SM120, entry, arch
        if capability[0] in FLASHMLA_ARCHS:
            if shapes:
                return REFERENCE, None, f"{arch}: {shapes}"
            module, why_not = self._load(FLASHMLA, self.load_flash_mla)
            if module is None:
                return REFERENCE, None, f"{arch}: FlashMLA does not import ({why_not})"
            return FLASHMLA, module, arch
        return (
            REFERENCE,
            None,
            f"{arch}: no real DSV4 sparse-MLA kernel for it (FlashMLA: SM90/SM100, FlashInfer: SM120)",
        )

    def compute(self, query, swa_kv_cache, swa_indices, swa_lens, compressed_kv_cache, extra_indices, extra_lens,
                out, sm_scale, sinks, lse, *, entry_call=None) -> str:  # fmt: skip
        """The reference kernel's call, computed by the chosen kernel -> its name."""
        args = (query, swa_kv_cache, swa_indices, swa_lens, compressed_kv_cache, extra_indices, extra_lens, out,
                sm_scale, sinks, lse)  # fmt: skip
        kernel, real, why = self.choose(query, swa_kv_cache, compressed_kv_cache, entry_call)
        self.last = None
        if kernel == REFERENCE:
            reference.sparse_attention_with_lse(*args)
            cross_check.log({"kernel": kernel, "why": why})
        elif kernel == FLASHMLA:
            self.last = cross_check.checked(kernel, lambda *a: flashmla.sparse_attention_with_lse(real, *a), *args)
        else:
            self.last = cross_check.checked(
                kernel, lambda *a: sm120_entry_computes(real, entry_call, a[7], a[10]), *args
            )
        return kernel

    def describe(self, device: torch.device | None = None) -> str:
        """The header's account: which kernel computes which calls here, and why."""
        device = device or (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
        capability = self.capability(device)
        if capability is None:
            return "the reference kernel (no GPU)"
        arch = f"SM{capability[0]}{capability[1]}"
        production = f"calls at head dim {flashmla.HEAD_DIM} over the {flashmla.V4_RECORD_BYTES}-byte fp8_ds_mla record"
        rest = "the reference kernel computes every other call (the scaled-down records, bf16 pages)"
        if capability[0] in FLASHMLA_ARCHS:
            version = installed_version(flashmla.DISTRIBUTION)
            if version is None:
                return f"the reference kernel ({arch}: FlashMLA not installed: tools/carry_flashmla.py)"
            return (
                f"FlashMLA ({flashmla.DISTRIBUTION} {version}, legacy sparse decode, kv_format={flashmla.KV_FORMAT}) "
                f"on {arch} for {production}, each cross-checked by the reference kernel; {rest}"
            )
        if capability[0] == SM120_ARCH:
            version = installed_version("flashinfer-python")
            if version is None:
                return f"the reference kernel ({arch}: FlashInfer not installed)"
            return (
                f"FlashInfer {version}'s _trtllm_batch_decode_sparse_mla_sm120 on {arch} for {production} "
                f"through the SM120 entry, each cross-checked by the reference kernel; {rest}"
            )
        return f"the reference kernel ({arch}: no real DSV4 sparse-MLA kernel for it)"


def sm120_entry_computes(entry, entry_call: dict, out_flat: torch.Tensor, lse_flat: torch.Tensor) -> None:
    """FlashInfer's own entry on the port's call, writing the stand-in's ``out``/``lse`` (base 2, ``lse_scale`` 1)."""
    query = entry_call["query"]
    call = dict(entry_call, out=out_flat.view(query.shape), lse=lse_flat, return_lse=True, lse_scale=1.0)
    entry(**call)
