"""``python -m dcpcheck``: the main job.

Runs the staged suite (every stage test, not the harness self-tests) on the
chosen implementation and ends with the stage table; any extra arguments go
to pytest (``--dcp-impl``, ``--world-sizes``, ``-k``, ``-rs``, ...).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dcpcheck.stages import SUITE_TEST_DIRS


def main(argv: list[str] | None = None) -> int:
    root = Path(__file__).resolve().parent.parent
    targets = [str(root / folder) for folder in SUITE_TEST_DIRS if (root / folder).is_dir()]
    if not targets:
        print(
            f"dcpcheck: no stage tests under {root / 'tests'}: run from a checkout of the dcpcheck repository",
            file=sys.stderr,
        )
        return 4
    args = list(sys.argv[1:] if argv is None else argv)
    # Failures, errors and expected failures in pytest's summary; the skips are
    # summed by reason under the stage table (``-rs`` lists each again).
    return int(pytest.main(["-q", "-rfExX", *targets, *args]))


if __name__ == "__main__":
    sys.exit(main())
