"""``python -m dcpcheck``: the main job.

Runs the staged suite (every stage test, not the harness self-tests) on the
chosen implementation and prints the stage table; any extra arguments go to
pytest (``--dcp-impl``, ``--world-sizes``, ``-k``, ...).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

STAGE_TEST_DIRS = ("stage1_index", "stage3_combine", "stage9_prefill", "e2e")


def main(argv: list[str] | None = None) -> int:
    tests = Path(__file__).resolve().parent.parent / "tests"
    targets = [str(tests / name) for name in STAGE_TEST_DIRS if (tests / name).is_dir()]
    if not targets:
        print(f"dcpcheck: no stage tests under {tests}: run from a checkout of the dcpcheck repository", file=sys.stderr)
        return 4
    args = list(sys.argv[1:] if argv is None else argv)
    return int(pytest.main(["-q", *targets, *args]))


if __name__ == "__main__":
    sys.exit(main())
