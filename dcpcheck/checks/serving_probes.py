"""The rank function of the serving-model checks (stages 1 and 3): one probe
of the implementation's ``serving_probes()``, failing with what it found."""

from __future__ import annotations

from dcpcheck.compare import MismatchError


def check_serving_probe(ctx, *, name):
    finding = ctx.impl.serving_probes()[name]
    if finding is not None:
        raise MismatchError(f"{name}: {finding}")
