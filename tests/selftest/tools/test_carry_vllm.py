"""``tools/carry_vllm.py`` carries what the GPU image lacks, and only that:
a package the image holds at a version meeting every requirement on it (or
unconstrained) stays the image's; one it lacks or holds at an unknown or
wrong version travels, at the version installed here, with what it needs."""

from __future__ import annotations

import importlib.metadata as metadata
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))

from carry_vllm import wheels_to_carry  # tools/ is on sys.path


def test_what_the_image_satisfies_stays_the_images():
    image = {"pytest": Version(metadata.version("pytest")), "pluggy": None}
    assert wheels_to_carry([Requirement("pytest>=1"), Requirement("pluggy")], image) == {}


def test_a_wrong_version_travels_with_what_it_needs():
    image = {"pytest": Version("0.1"), "pluggy": Version("0.1"), "iniconfig": None, "packaging": None}
    carried = wheels_to_carry([Requirement("pytest>=1")], image)
    assert carried["pytest"] == metadata.version("pytest")
    assert carried["pluggy"] == metadata.version("pluggy")  # pytest pins pluggy above 0.1


def test_an_unknown_version_under_a_specifier_travels():
    assert wheels_to_carry([Requirement("pluggy>=1")], {"pluggy": None}) == {"pluggy": metadata.version("pluggy")}


def test_the_hosts_torch_never_travels():
    assert wheels_to_carry([Requirement("torch>=2")], {}) == {}
