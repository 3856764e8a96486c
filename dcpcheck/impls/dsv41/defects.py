"""Known defects of the seed DCP2 port, keyed on contract terms; each reason
names the seed line and points at docs/dsv41.md."""

from __future__ import annotations


def port_defect(**case) -> str | None:
    return None
