"""DCPCHECK_PROFILE is read once, when this folder is collected: a bad value is a usage error. The folder's
cases run from the largest world size down."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcpcheck.scenarios.production import production_selected


def pytest_configure(config):
    try:
        production_selected("cpu")
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None


def pytest_collection_modifyitems(config, items):
    """This folder's cases from the largest W down, each W's in file order. tools/gpu_ci.py runs them beside
    sessions whose pools of rank processes grow as they go: at W = 8 a case needs most of one H100, and at the
    end of its session, beside them, one ran out of memory (H100, at 1b1ce93)."""
    here = Path(__file__).parent
    mine = [index for index, item in enumerate(items) if here in item.path.parents]
    ordered = sorted((items[index] for index in mine), key=lambda item: -_world_size(item))
    for index, item in zip(mine, ordered):
        items[index] = item


def _world_size(item) -> int:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("dcp", 0) if callspec is not None else 0
