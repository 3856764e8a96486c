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
# SEED_PATHS). The tree is built in a folder beside OUT_DIR and moved to
# OUT_DIR/vllm (replacing an earlier one; OUT_DIR's other files stay) only when
# every hunk applied. A hunk that does not apply is an error naming its file
# and @@ line: exit 2, and OUT_DIR is left as it was; so is any refusal: an
# OUT_DIR that is, holds or lies inside the installed vLLM, a file reached
# through a folder link, a diff that removes a file the port imports, odd
# paths and bytes that are not UTF-8 (apply_diff.py). Nothing outside OUT_DIR
# is written or deleted. A tree of your own is not built: run the suite with
# PYTHONPATH=YOUR_TREE. Run the suite with PYTHONPATH=OUT_DIR so this tree
# shadows the installed one.
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

# The installed vLLM the venv imports (its own, or one PYTHONPATH names, as on a GPU host's carry), never a
# DCP2 tree PYTHONPATH puts first (an earlier build, the carry's dsv41-tree): a tree's files are links.
src=$("$VENV/bin/python" - 2>/dev/null <<'PY'
import os, sys
sys.path[:] = [p for p in sys.path if not os.path.islink(os.path.join(p or ".", "vllm", "__init__.py"))]
import vllm
print(os.path.realpath(os.path.dirname(vllm.__file__)))
PY
) || {
  echo "error: no vLLM in $VENV (run tools/install_vllm_cpu.sh $VENV first)" >&2
  exit 2
}
if [ -d "$DIFF" ]; then
  echo "error: $DIFF is a folder: a tree is used as it is, not built (PYTHONPATH=$DIFF; tools/diff_coverage.py --tree $DIFF)" >&2
  exit 2
fi
[ -f "$DIFF" ] || { echo "error: no diff at $DIFF" >&2; exit 2; }

# Nothing outside OUT is ever deleted or written: an OUT that is, holds or lies inside the
# installed vLLM would have its replaced vllm/ be (or hold) the install itself.
out=$(realpath -m -- "$OUT")
case "$src/" in "${out%/}/"*) overlap=yes ;; *) overlap=no ;; esac
case "$out/" in "$src/"*) overlap=yes ;; esac
if [ "$overlap" = yes ]; then
  echo "error: $OUT is, holds or lies inside the vLLM it mirrors ($src); accepted: a folder apart from it, e.g. build/dsv41-tree" >&2
  exit 2
fi
if [ -e "$out" ] && [ ! -d "$out" ]; then
  echo "error: $OUT is a file; accepted: a folder that exists or can be made" >&2
  exit 2
fi
parent=$(dirname -- "$out")
mkdir -p -- "$parent" 2>/dev/null || { echo "error: cannot make $parent; accepted: a folder that exists or can be made" >&2; exit 2; }

# The tree is built beside OUT and swapped in only when every hunk applied: a half-patched tree
# would be checked as if it were the port, and OUT (its earlier tree, the user's files) stays whole.
work=$(mktemp -d -- "$parent/.$(basename -- "$out").building.XXXXXX" 2>/dev/null) || {
  echo "error: cannot make a folder in $parent to build in beside $OUT; accepted: an OUT_DIR whose folder is writable" >&2
  exit 2
}
trap 'rm -rf -- "$work"' EXIT
trap 'exit 130' INT TERM HUP
cp -rs "$src" "$work/vllm"
find "$work/vllm" -name __pycache__ -prune -exec rm -rf {} +

"$VENV/bin/python" "$ROOT/tools/apply_diff.py" "$work" "$src" "$DIFF" || exit $?

# Where the diff removed the companion, the port does not import it (apply_diff.py refuses that).
companion="$work/$COMPANION"
if [ -f "$companion" ] && ! grep -q "_PREFILL_TIMING" "$companion"; then
  case "$(realpath -- "$(dirname -- "$companion")")/" in
    "$work/"*) ;;
    *) echo "error: $COMPANION: outside the tree (its folder is a link); accepted: a vLLM whose folders are its own" >&2; exit 2 ;;
  esac
  # Append to a copy: through the link it would change the installed vLLM.
  if [ -L "$companion" ]; then
    cp --remove-destination "$src/${COMPANION#vllm/}" "$companion"
  fi
  cat >>"$companion" <<'PY'


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

mkdir -p -- "$out"
if [ -e "$out/vllm" ] || [ -L "$out/vllm" ]; then
  mv -- "$out/vllm" "$work/earlier"  # removed with $work on exit
fi
mv -- "$work/vllm" "$out/vllm"
echo "DCP2 tree in $OUT (PYTHONPATH=$OUT) from $DIFF"
