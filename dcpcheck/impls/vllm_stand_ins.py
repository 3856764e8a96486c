"""Stand-ins for vLLM's compiled extensions, where they were not installed.

On a GPU host vLLM can be carried as Python sources alone
(``tools/carry_vllm.py``): its compiled extensions are hundreds of MB and
built for another torch. The DCP functions the suite checks are Triton
kernels and Python, but on CUDA importing their modules reaches three
compiled names. Each gets a stand-in here, and only when the real one is not
installed:

* ``vllm._C_stable_libtorch``: ``vllm/platforms/cuda.py`` imports it at
  module level (it registers ``torch.ops._C``);
* ``torch.ops._C.cutlass_scaled_mm_supports_block_fp8``: called at import by
  ``quantization/utils/w8a8_utils.py`` to pick the fp8 GEMM; it answers
  False (no CUTLASS block-fp8 GEMM), which only fp8 linear layers read;
* ``vllm.vllm_flash_attn._vllm_fa2_C``: ``vllm/vllm_flash_attn/__init__.py``
  refuses to import without a flash-attention extension, and the DSV4.1
  modules import it through ``fa_utils``.

The module stand-ins have no attributes: a checked function reaching one
fails with an AttributeError that names it. Every stand-in installed is
declared in the run header (:func:`install_stand_ins` returns the lines).
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types

WHY = "compiled extensions not carried"
_STABLE_LIBTORCH = "vllm._C_stable_libtorch"
_BLOCK_FP8_OP = "cutlass_scaled_mm_supports_block_fp8"
_FLASH_ATTN_EXTENSIONS = ("vllm.vllm_flash_attn._vllm_fa2_C", "vllm.vllm_flash_attn._vllm_fa3_C")


class _AbsentExtension(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"{self.__name__} is dcpcheck's empty stand-in ({WHY}): it has no {name!r}")


def _installed(module_name: str) -> bool:
    """Whether vLLM's install has the module's file, found without importing its
    package (``vllm.vllm_flash_attn`` raises at import without an extension)."""
    if module_name in sys.modules:
        return True
    top, *packages, leaf = module_name.split(".")
    folders = [os.path.join(folder, *packages) for folder in sys.modules[top].__path__]
    return importlib.machinery.PathFinder.find_spec(leaf, folders) is not None


def _stand_in_module(module_name: str) -> None:
    sys.modules[module_name] = _AbsentExtension(module_name)


def _no_block_fp8_gemm(cuda_device_capability: int) -> bool:
    return False


def install_stand_ins() -> tuple[str, ...]:
    """Install the stand-ins this vLLM install needs (none on a full install);
    one header line per stand-in installed, in the order vLLM reaches them.
    ``vllm`` itself must be imported."""
    import torch

    declared = []
    if not _installed(_STABLE_LIBTORCH):
        _stand_in_module(_STABLE_LIBTORCH)
        declared.append(f"`{_STABLE_LIBTORCH}`: stand-in ({WHY}): an empty module")
        if not hasattr(torch.ops._C, _BLOCK_FP8_OP):
            setattr(torch.ops._C, _BLOCK_FP8_OP, _no_block_fp8_gemm)
            declared.append(f"`torch.ops._C.{_BLOCK_FP8_OP}`: stand-in ({WHY}): False, read at import by w8a8_utils")
    if not any(_installed(name) for name in _FLASH_ATTN_EXTENSIONS):
        _stand_in_module(_FLASH_ATTN_EXTENSIONS[0])
        declared.append(f"`{_FLASH_ATTN_EXTENSIONS[0]}`: stand-in ({WHY}): an empty module")
    return tuple(declared)
