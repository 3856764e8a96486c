"""DCPCHECK_PROFILE is read once, when this folder is collected: a bad value is a usage error."""

from __future__ import annotations

import pytest

from dcpcheck.scenarios.production import production_selected


def pytest_configure(config):
    try:
        production_selected("cpu")
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None
