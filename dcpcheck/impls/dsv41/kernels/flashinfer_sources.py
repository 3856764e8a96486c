"""The FlashInfer release the tree's vLLM pins, as source to execute pieces of,
never imported (importing FlashInfer loads its CUDA packages).

vLLM declares its FlashInfer among its distribution's requirements (vLLM
0.33.0: ``flashinfer-python==0.7.2.post1``). ``tools/install_vllm_cpu.sh``
downloads that wheel (``--no-deps``) and unpacks the sources dcpcheck reads
into ``SOURCES_FOLDER`` beside the installed vLLM (``tools/carry_vllm.py``
takes that folder to a GPU host); an installed ``flashinfer-python`` of the
pinned version serves as well.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import sys
from dataclasses import dataclass
from pathlib import Path

DISTRIBUTION = "flashinfer-python"
SOURCES_FOLDER = "dcpcheck-flashinfer-sources"  # not a module name: nothing imports it
CORE = "flashinfer/mla/_core.py"  # the SM120 entry and what it checks its arguments with
SPARSE_MLA_POLICY = "flashinfer/mla/_sparse_mla_sm120/_policy.py"  # the SM120 kernel's static decode envelope
SPARSE_MLA_API = "flashinfer/mla/_sparse_mla_sm120/_api.py"  # its configuration query's config class
INSTALL_HINT = "run tools/install_vllm_cpu.sh with this venv (it unpacks them; nothing of FlashInfer is imported)"


class FlashInferSourcesError(ValueError):
    """The sources of the FlashInfer vLLM pins are not there to read."""


@dataclass(frozen=True)
class FlashInferSources:
    version: str
    root: Path  # the folder holding flashinfer/

    @property
    def core(self) -> Path:
        return self.root / CORE

    @property
    def sparse_mla_policy(self) -> Path:
        return self.root / SPARSE_MLA_POLICY

    @property
    def sparse_mla_api(self) -> Path:
        return self.root / SPARSE_MLA_API


def pinned_version() -> str:
    """The ``flashinfer-python`` version vLLM's distribution requires (``==``)."""
    try:
        requirements = metadata.requires("vllm") or []
    except metadata.PackageNotFoundError as exc:
        raise FlashInferSourcesError(
            f"no vLLM distribution installed to read its FlashInfer pin from; {INSTALL_HINT}"
        ) from exc
    for requirement in requirements:
        pinned = re.fullmatch(rf"{DISTRIBUTION}\s*==\s*([^\s;,]+)\s*(;.*)?", requirement.strip())
        if pinned:
            return pinned.group(1)
    raise FlashInferSourcesError(
        f"vLLM {metadata.version('vllm')} pins no {DISTRIBUTION} version (its requirements: {requirements})"
    )


def unpacked_folder(site: Path, version: str) -> Path:
    """Where the install script unpacks ``version``'s sources under a site folder."""
    return site / SOURCES_FOLDER / f"{DISTRIBUTION}-{version}"


def pinned_sources() -> FlashInferSources:
    """The pinned release's sources: unpacked beside a vLLM on ``sys.path``, or installed."""
    version = pinned_version()
    for entry in sys.path:
        root = unpacked_folder(Path(entry or "."), version)
        if (root / CORE).is_file():
            return FlashInferSources(version, root)
    try:
        installed = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        installed = None
    if installed is not None and installed.version == version:
        root = Path(installed.locate_file(""))
        if (root / CORE).is_file():
            return FlashInferSources(version, root)
    raise FlashInferSourcesError(
        f"the sources of {DISTRIBUTION}=={version} (vLLM's pin) are not on sys.path "
        f"({SOURCES_FOLDER}/{DISTRIBUTION}-{version}/{CORE} under a sys.path entry): {INSTALL_HINT}"
    )
