"""The port's stage gate: ``DSV41_DCP_STAGE`` says how far the DCP port is.

Building the DCP attention path with W > 1 needs stage 3 (partial attention
+ LSE combine): below it a DCP rank would attend over its shard alone and
return wrong outputs silently, so the build refuses, naming the variable and
the way out. The check runs once the KV layout is known and valid, and before
any forward or collective, so no rank is left waiting in a collective. W = 1
is plain attention and builds at any stage; unset means every stage.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .conventions import COMBINE_STAGE, PREFILL_GATHER_ENV, STAGE_ENV
from .layer import DcpAttentionLayer, validate_layout


def reached_stage(environ: Mapping[str, str] = os.environ) -> int | None:
    """The stage ``DSV41_DCP_STAGE`` names; None when unset or empty (all stages)."""
    raw = environ.get(STAGE_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ValueError(f"{STAGE_ENV}={raw!r}: accepted a non-negative integer stage, or unset for every stage")
    return int(raw)


def require_dcp_stage(world_size: int, environ: Mapping[str, str] = os.environ) -> None:
    """Raise NotImplementedError when W > 1 and the port has not reached stage 3."""
    stage = reached_stage(environ)
    if world_size > 1 and stage is not None and stage < COMBINE_STAGE:
        raise NotImplementedError(
            f"DCP attention with world size {world_size} needs port stage {COMBINE_STAGE} (partial "
            f"attention + LSE combine), but {STAGE_ENV}={stage}: set {STAGE_ENV}>={COMBINE_STAGE} "
            f"(or unset it) or run with DCP world size 1"
        )


def prefill_gather_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(PREFILL_GATHER_ENV, "").strip() == "1"


def build_attention(
    impl, layout, group, *, prefill_gather: bool | None = None, stack=None, max_model_len=None, **options
) -> DcpAttentionLayer:
    """The DCP attention layer of ``layout`` on ``group``, composed of
    ``impl``'s capabilities; the environment is read here, at build time.
    ``prefill_gather=None`` follows ``DSV41_DCP_PREFILL_GATHER=1``; ``stack``
    (the layer's place in the model's topology) and ``max_model_len`` play no
    part: this port's layer is its layout, its block tables the caller's; other
    options go to :class:`DcpAttentionLayer`."""
    validate_layout(layout, group.world_size)
    require_dcp_stage(group.world_size)
    if prefill_gather is None:
        prefill_gather = prefill_gather_enabled()
    return DcpAttentionLayer(impl, layout, group, prefill_gather=prefill_gather, **options)
