"""FlashMLA for ``--dcp-impl dsv41`` on an SM90/SM100 GPU host without a package index:
the ``sgl-flash-mla`` wheel (stable ABI, ``cp310-abi3``; its ``flash_mla_legacy`` ops keep SM90
and vLLM's V4 record). Here, once (into ``.whl/``, ignored by git; the device tool carries it
with ``carry: [".whl"]``):

    .venv/bin/python tools/carry_flashmla.py download

On the GPU host, from the repository root (beside ``tools/carry_vllm.py``'s carry, whose
``/tmp/vllm/site`` is already on ``PYTHONPATH``):

    python3 tools/carry_flashmla.py install [DEST, default /tmp/vllm/site]

The wheel's metadata asks for torch >= 2.14.1; it is installed without its dependencies, over
the host's own torch (2.11 on the device tool's image, where it loads: measured). The run
header names the version it finds (``dcpcheck/impls/dsv41/kernels/selection.py``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".whl"
PIN = "sgl-flash-mla==1.0.0"
WHEEL_GLOB = "sgl_flash_mla-1.0.0-*.whl"
DEFAULT_DEST = Path("/tmp/vllm/site")
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_28_x86_64")


def download(folder: Path) -> int:
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12"]
    command += ["--implementation", "cp", *platforms, "-d", str(folder), PIN]
    return subprocess.run(command).returncode


def install(folder: Path, dest: Path) -> int:
    wheels = sorted(folder.glob(WHEEL_GLOB))
    if not wheels:
        print(f"error: no {WHEEL_GLOB} in {folder}: run tools/carry_flashmla.py download first", file=sys.stderr)
        return 2
    dest.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade"]
    result = subprocess.run([*command, "--target", str(dest), str(wheels[-1])])
    if result.returncode == 0:
        print(f"{wheels[-1].name} installed in {dest}; with it on PYTHONPATH: import flash_mla")
    return result.returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    fetch = verbs.add_parser("download", help=f"pip download {PIN} (no dependencies) into .whl/")
    fetch.add_argument("--wheels", type=Path, default=WHEELS)
    put = verbs.add_parser("install", help="install the downloaded wheel under DEST (on the GPU host)")
    put.add_argument("dest", type=Path, nargs="?", default=DEFAULT_DEST)
    put.add_argument("--wheels", type=Path, default=WHEELS)
    args = parser.parse_args(argv)
    return download(args.wheels) if args.verb == "download" else install(args.wheels, args.dest)


if __name__ == "__main__":
    sys.exit(main())
