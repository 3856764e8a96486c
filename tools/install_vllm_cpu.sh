#!/usr/bin/env bash
# Install vLLM's DCP primitives into a CPU-only venv, for `--dcp-impl vllm`.
#
#   tools/install_vllm_cpu.sh [VENV]        (default: .venv)
#
# The venv must already hold torch 2.13.0 and triton (pip install
# torch==2.13.0 triton==3.9.0: the CPU build here). vLLM itself goes in with
# --no-deps: its declared requirements (torch==2.14.0, flashinfer, CUDA
# kernels, ...) would replace the CPU torch with a multi-GB CUDA build. Only the pure-Python packages that
# importing its DCP modules needs are installed, under a constraints file that
# pins torch and triton, so nothing can replace them. Then the source of the
# FlashInfer release vLLM pins (flashinfer-python==0.7.2.post1 for 0.33.0) is
# unpacked beside vLLM, for --dcp-impl dsv41 to read, never import
# (dcpcheck/impls/dsv41/kernels/flashinfer_sources.py): the wheel is downloaded with
# --no-deps and only the files of FLASHINFER_SOURCES leave it. Idempotent: a venv
# that already passes the check is left as it is.
set -euo pipefail

VENV=${1:-.venv}
PY="$VENV/bin/python"
VLLM_VERSION=0.33.0
TORCH_VERSION=2.13.0

# The pure-Python packages importing vLLM's DCP modules needs (one home,
# shared with tools/carry_vllm.py).
REQUIREMENTS="$(cd "$(dirname "$0")" && pwd)/vllm-import-requirements.txt"

# The check: the three functions the adapter binds import on CPU, under the
# Triton interpreter, and torch is the very build found before installing.
verify() {
  CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 "$PY" - "$VLLM_VERSION" "$installed_torch" <<'EOF'
import sys
import torch
import einops  # noqa: F401  (the DeepSeek-V4.1 modules need it)
import vllm
from vllm.v1.attention.ops.dcp import cp_lse_ag_out_rs, dcp_a2a_lse_reduce
from vllm.v1.attention.backends.mla.sparse_utils import (
    triton_filter_and_convert_dcp_index,
)
want_vllm, want_torch = sys.argv[1:]
assert vllm.__version__ == want_vllm, f"vllm {vllm.__version__} != {want_vllm}"
assert torch.__version__ == want_torch, f"torch {want_torch} became {torch.__version__}"
print(f"ok: vllm {vllm.__version__} DCP functions import on torch {torch.__version__}")
EOF
}

if [ ! -x "$PY" ]; then
  echo "error: no venv at $VENV (create it: python3 -m venv $VENV &&" \
    "$VENV/bin/pip install torch==$TORCH_VERSION triton==3.9.0 numpy)" >&2
  exit 2
fi
if ! installed_torch=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null) \
  || [ "${installed_torch%%+*}" != "$TORCH_VERSION" ]; then
  echo "error: $VENV needs torch==$TORCH_VERSION installed first (found:" \
    "${installed_torch:-none}); this script never installs torch" >&2
  exit 2
fi
if ! installed_triton=$("$PY" -c 'import importlib.metadata as m; print(m.version("triton"))' 2>/dev/null); then
  echo "error: $VENV needs triton installed first (pip install triton==3.9.0)" >&2
  exit 2
fi

# The FlashInfer sources --dcp-impl dsv41 reads, of vLLM's pin, under
# SITE/dcpcheck-flashinfer-sources/flashinfer-python-VERSION/: the SM120 entry
# (mla/_core.py) and the SM120 kernel's configuration query (its static decode
# envelope, _policy.py, and the config class of supported_sparse_mla_sm120_configs, _api.py).
FLASHINFER_SOURCES="flashinfer/mla/_core.py flashinfer/mla/_sparse_mla_sm120/_policy.py flashinfer/mla/_sparse_mla_sm120/_api.py"
install_flashinfer_sources() {
  local pin site dest wheels
  pin=$("$PY" -c 'from dcpcheck.impls.dsv41.kernels.flashinfer_sources import pinned_version; print(pinned_version())') || {
    echo "error: cannot read vLLM's FlashInfer pin (is dcpcheck installed in $VENV: pip install -e .?)" >&2
    exit 2
  }
  site=$("$PY" -c 'import os, vllm; print(os.path.dirname(os.path.dirname(vllm.__file__)))')
  dest="$site/dcpcheck-flashinfer-sources/flashinfer-python-$pin"
  local file missing=""
  for file in $FLASHINFER_SOURCES; do
    [ -f "$dest/$file" ] || missing=1
  done
  if [ -z "$missing" ]; then
    echo "flashinfer-python $pin sources already in $dest"
    return
  fi
  wheels=$(mktemp -d)
  "$VENV/bin/pip" download --quiet --no-deps --only-binary :all: "flashinfer-python==$pin" -d "$wheels"
  # shellcheck disable=SC2086  # one argument per file
  "$PY" -c 'import sys, zipfile, glob; wheel = zipfile.ZipFile(glob.glob(sys.argv[1] + "/*.whl")[0]); [wheel.extract(name, sys.argv[2]) for name in sys.argv[3:]]' \
    "$wheels" "$dest" $FLASHINFER_SOURCES
  rm -rf "$wheels"
  echo "flashinfer-python $pin sources (read, never imported) in $dest"
}

if report=$(verify 2>/dev/null); then
  echo "$report"
  echo "already installed in $VENV"
  install_flashinfer_sources
  exit 0
fi

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
printf 'torch==%s\ntriton==%s\n' "$TORCH_VERSION" "$installed_triton" >"$constraints"

start=$SECONDS
echo "installing vllm==$VLLM_VERSION (--no-deps) and the pure-Python deps of $REQUIREMENTS into $VENV"
# Deps first: installed after vLLM, they would make pip list all of vLLM's
# other (GPU) requirements as conflicts. `pip check` still does: expected.
"$VENV/bin/pip" install --quiet -c "$constraints" -r "$REQUIREMENTS"
"$VENV/bin/pip" install --quiet -c "$constraints" --no-deps "vllm==$VLLM_VERSION"
verify
install_flashinfer_sources
echo "installed in $((SECONDS - start)) s; $VENV is $(du -sh "$VENV" | cut -f1)"
