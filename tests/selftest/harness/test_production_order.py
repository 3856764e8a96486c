"""tests/production runs from the largest world size down (its conftest.py): at W = 8 a case needs most of one
H100, and tools/gpu_ci.py runs the folder beside sessions whose pools grow as they go."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_the_production_cases_run_from_the_largest_world_size_down():
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/production"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stdout + listed.stderr
    worlds = [int(w) for w in re.findall(r"^tests/production/\S+\[W(\d+)", listed.stdout, re.MULTILINE)]
    assert worlds[0] == 8 and len(set(worlds)) == 4, listed.stdout
    assert worlds == sorted(worlds, reverse=True), listed.stdout
