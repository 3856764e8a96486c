"""The installed Triton interpreter patches, for the self-tests that check them."""

from __future__ import annotations

import pytest
import triton

from dcpcheck import triton_interpreter


def installed_where_patched(patch: str):
    """The installed ``patch`` (an attribute of :class:`~dcpcheck.triton_interpreter.Installation`); a skip
    under a Triton version dcpcheck leaves as shipped or where the run asks for it as shipped, and a failure
    where it patches this version and :func:`~dcpcheck.triton_interpreter.install` installed nothing."""
    pinned, opt_out = triton_interpreter.PINNED_VERSIONS, triton_interpreter.AS_SHIPPED_ENV
    if triton.__version__ not in pinned:
        pytest.skip(f"triton {triton.__version__}'s interpreter runs as shipped: PINNED_VERSIONS is {pinned}")
    if triton_interpreter.as_shipped_requested():
        pytest.skip(f"{opt_out}=1: the interpreter runs as shipped")
    installation = triton_interpreter.install()
    assert installation.as_shipped is None, installation.header_line()
    return getattr(installation, patch)
