"""Case parameters the tests spell as names (ids and failure messages stay
short), the values they stand for, and a case in the contract's terms
(:class:`dcpcheck.impls.protocol.CaseTerms`), as the plugin builds it for
every case before launch."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from dcpcheck.impls.protocol import SCENARIO_PROPERTIES, CaseTerms

LSE_BASES = {"2": 2.0, "e": math.e}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def case_terms(
    *, device: str, world_size: int, capabilities: Iterable[str], properties: Iterable[str] = (), case: dict
) -> CaseTerms:
    """``case`` (a rank function's parameters) in the contract's terms. The
    parameters read are ``backend``, ``lse_base`` (a name of LSE_BASES or a
    number), ``dtype_name`` (a name of DTYPES) and ``head_dim``; every other
    parameter is the test's own."""
    unknown = sorted(set(properties) - set(SCENARIO_PROPERTIES))
    if unknown:
        raise ValueError(f"unknown scenario properties {unknown}; known: {sorted(SCENARIO_PROPERTIES)}")
    lse_base = case.get("lse_base")
    dtype_name = case.get("dtype_name")
    return CaseTerms(
        device=device,
        world_size=world_size,
        capabilities=frozenset(capabilities),
        backend=case.get("backend"),
        lse_base=LSE_BASES[lse_base] if isinstance(lse_base, str) else lse_base,
        dtype=DTYPES[dtype_name] if dtype_name is not None else None,
        head_dim=case.get("head_dim"),
        properties=frozenset(properties),
    )
