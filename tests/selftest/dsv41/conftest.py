"""The dsv41 self-tests call the kernel adapter with fakes and planted breaks: their calls stay out of the kernel
log (``$DCPCHECK_KERNEL_LOG``), which is the record of real kernels' calls that tools/gpu_ci.py's summary reads (a
plant's calls there read as FlashMLA off by inf: H100, at 3fadbde). A test that reads the log sets its own."""

from __future__ import annotations

import pytest

from dcpcheck.impls.dsv41.kernels import cross_check


@pytest.fixture(autouse=True)
def no_kernel_log(monkeypatch):
    monkeypatch.delenv(cross_check.LOG_ENV, raising=False)
