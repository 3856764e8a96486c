"""Make the carry that takes vLLM and the DCP2-ported tree to a GPU host
without a package index (the device tool's H200, Python 3.12):

    .venv/bin/python tools/carry_vllm.py OUT [--tree build/dsv41-tree]
        [--image-packages tools/gpu_image_packages.txt]

From the CPU install (``tools/install_vllm_cpu.sh``, ``tools/build_dsv41_tree.sh``)
it writes to OUT:

* ``vllm-src.tar.gz``: vLLM's Python sources and its dist-info (vLLM's
  platform detection reads the version), and beside them the source of the
  FlashInfer release vLLM pins that ``--dcp-impl dsv41`` reads (unpacked by
  ``tools/install_vllm_cpu.sh``). Its compiled extensions stay
  behind: hundreds of MB, built for another torch; the DCP functions are
  Triton kernels and Python, and ``dcpcheck/impls/vllm_stand_ins.py`` stands
  in for the three compiled names their import reaches on CUDA;
* ``dsv41-tree.tar.gz``: the tree's own files (the patched port and its
  companion), the rest of that tree being links to vLLM's files;
* ``wheels/``: cp312 manylinux wheels of what importing vLLM needs
  (``tools/vllm-import-requirements.txt`` and what those need, at the
  versions installed here) that the GPU image does not hold: a package is
  left to the image only where the image's version is known to satisfy every
  requirement on it, or where nothing constrains its version;
* ``install.sh``: unpacks it all under a folder of the host.

It prints the size and the one line to run on the host, and refuses a carry
over the device tool's 64 MiB.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import importlib.util
import subprocess
import sys
import tarfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from dcpcheck.impls.dsv41.kernels.flashinfer_sources import SOURCES_FOLDER

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "tools" / "vllm-import-requirements.txt"
IMAGE_PACKAGES = ROOT / "tools" / "gpu_image_packages.txt"
CARRY_LIMIT = 64 * 2**20  # the device tool's working tree, per call
HOST_PYTHON = ("3.12", "3.12.3")
# The host's own builds, never replaced: a carried torch or triton would shadow its CUDA build.
HOST_OWNED = {"torch", "triton", "numpy"}
# The host's glibc is 2.39 (Ubuntu 24.04); pip matches manylinux_2_N tags exactly.
PLATFORMS = (*(f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)), "manylinux2014_x86_64", "manylinux1_x86_64")

INSTALL_SH = """#!/usr/bin/env bash
# Written by tools/carry_vllm.py. Unpacks the carry beside it under DEST:
# DEST/site (the wheels, then vLLM's sources) and DEST/dsv41-tree (links to
# DEST/site/vllm, except the DCP2 port's own files). Then, for both
# --dcp-impl vllm and dsv41: export PYTHONPATH=DEST/dsv41-tree:DEST/site
set -euo pipefail
CARRY=$(cd "$(dirname "$0")" && pwd)
DEST=$(mkdir -p "${1:?usage: install.sh DEST}" && cd "$1" && pwd)
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
  --target "$DEST/site" "$CARRY"/wheels/*.whl
tar -xzf "$CARRY/vllm-src.tar.gz" -C "$DEST/site"
rm -rf "$DEST/dsv41-tree" && mkdir -p "$DEST/dsv41-tree"
cp -rs "$DEST/site/vllm" "$DEST/dsv41-tree/"
tar -xzf "$CARRY/dsv41-tree.tar.gz" -C "$DEST/dsv41-tree" --unlink-first
# The bytecode pip writes at install (--no-compile above), on every core: else the first sessions to import
# vLLM compile it, each on one core. A file that does not compile fails its import as before.
python3 -m compileall -q -j 0 "$DEST/site" "$DEST/dsv41-tree" >/dev/null || true
echo "carry installed in $DEST in $((SECONDS - start)) s"
"""


class CarryError(RuntimeError):
    """The CPU install cannot make the carry; the message says what to run."""


def _distribution(name: str) -> metadata.Distribution:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        raise CarryError(
            f"{name} is not installed in {sys.prefix}: run tools/install_vllm_cpu.sh with this venv"
        ) from None


def _read_image_packages(path: Path) -> dict[str, Version | None]:
    """Canonical name -> version (None where the list gives none)."""
    image = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            image[canonicalize_name(name)] = Version(version) if version else None
    return image


def _host_environment(extra: str = "") -> dict[str, str]:
    env = default_environment()
    env.update(python_version=HOST_PYTHON[0], python_full_version=HOST_PYTHON[1], extra=extra)
    return env


def wheels_to_carry(requirements: list[Requirement], image: dict[str, Version | None]) -> dict[str, str]:
    """Canonical name -> the version installed here, for every distribution
    vLLM's import needs on the host that the image does not satisfy."""
    carried: dict[str, str] = {}
    pending = list(requirements)
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in carried or name in HOST_OWNED:
            continue
        if name in image:
            version = image[name]
            if version is None and not requirement.specifier:
                continue  # unconstrained: the image's will do
            if version is not None and requirement.specifier.contains(version, prereleases=True):
                continue
        dist = _distribution(requirement.name)
        carried[name] = dist.version
        for text in dist.requires or ():
            needed = Requirement(text)
            if needed.marker is None or needed.marker.evaluate(_host_environment()):
                pending.append(needed)
    return carried


def _download(wheels: dict[str, str], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", HOST_PYTHON[0], "--implementation", "cp", *platforms, "-d", str(folder)]
    pins = [f"{name}=={version}" for name, version in sorted(wheels.items())]
    result = subprocess.run([*command, *pins], capture_output=True, text=True)
    if result.returncode:
        raise CarryError(f"pip download of {' '.join(pins)} failed:\n{result.stderr.strip()}")
    stale = [p.name for p in folder.glob("*.whl") if canonicalize_name(p.name.split("-")[0]) not in wheels]
    for name in stale:  # a wheel of an earlier run the image now satisfies: two versions stop the install
        (folder / name).unlink()


def _pack_vllm_sources(out: Path) -> None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise CarryError(f"no vLLM in {sys.prefix}: run tools/install_vllm_cpu.sh with this venv")
    package = Path(next(iter(spec.submodule_search_locations)))
    dist_info = Path(_distribution("vllm")._path)  # the folder itself travels
    flashinfer = package.parent / SOURCES_FOLDER
    if not flashinfer.is_dir():
        raise CarryError(
            f"no {flashinfer}: run tools/install_vllm_cpu.sh with this venv (it unpacks FlashInfer's source)"
        )
    with tarfile.open(out / "vllm-src.tar.gz", "w:gz") as tar:
        for path in sorted([*package.rglob("*.py"), *flashinfer.rglob("*.py")]):
            if "__pycache__" not in path.parts:
                tar.add(path, arcname=str(path.relative_to(package.parent)))
        tar.add(dist_info, arcname=dist_info.name)


def _pack_tree(tree: Path, out: Path) -> list[str]:
    """The tree's own files (not links to vLLM's), as paths under the tree."""
    if not (tree / "vllm").is_dir():
        raise CarryError(f"no DCP2 tree at {tree}: run tools/build_dsv41_tree.sh {tree}")
    own = sorted(p for p in (tree / "vllm").rglob("*.py") if p.is_file() and not p.is_symlink())
    with tarfile.open(out / "dsv41-tree.tar.gz", "w:gz") as tar:
        for path in own:
            tar.add(path, arcname=str(path.relative_to(tree)))
    return [str(path.relative_to(tree)) for path in own]


def make_carry(out: Path, tree: Path, image_packages: Path) -> str:
    """Write the carry to ``out``; returns the report to print."""
    out.mkdir(parents=True, exist_ok=True)
    requirements = [Requirement(line) for line in _requirement_lines(REQUIREMENTS)]
    wheels = wheels_to_carry(requirements, _read_image_packages(image_packages))
    _download(wheels, out / "wheels")
    _pack_vllm_sources(out)
    tree_files = _pack_tree(tree, out)
    (out / "install.sh").write_text(INSTALL_SH)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    if size > CARRY_LIMIT:
        raise CarryError(f"the carry is {size / 2**20:.1f} MiB, over the device tool's {CARRY_LIMIT / 2**20:.0f} MiB")
    return "\n".join(
        [
            f"vllm {_distribution('vllm').version} sources, the DCP2 tree's {', '.join(tree_files)}, and "
            f"{len(wheels)} wheels: {' '.join(f'{n}-{v}' for n, v in sorted(wheels.items()))}",
            f"carry: {out} ({size / 2**20:.1f} MiB). On the GPU host, from the repository root:",
            f"bash {out}/install.sh /tmp/vllm && export PYTHONPATH=/tmp/vllm/dsv41-tree:/tmp/vllm/site",
        ]
    )


def _requirement_lines(path: Path) -> list[str]:
    return [line for line in (raw.split("#")[0].strip() for raw in path.read_text().splitlines()) if line]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write the carry to (an ignored path, e.g. build/gpu-carry)")
    parser.add_argument(
        "--tree", type=Path, default=ROOT / "build" / "dsv41-tree", help="tools/build_dsv41_tree.sh's output"
    )
    parser.add_argument(
        "--image-packages",
        type=Path,
        default=IMAGE_PACKAGES,
        help="what the host's Python holds: names, or name==version (`pip list --format=freeze`)",
    )
    args = parser.parse_args(argv)
    try:
        print(make_carry(args.out, args.tree, args.image_packages))
    except CarryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
