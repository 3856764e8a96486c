"""Conventions of the port's own kernels, kept apart from the suite's oracle.

The suite checks the port against an independent reference; a constant both
import would hide a wrong value, so the port owns its copy.
"""

from __future__ import annotations

# LSE the port's attention writes for a row with no candidate and no sink.
EMPTY_LSE = -1e30
# Partials with an LSE at or below this are empty: no weight in the combine.
# It takes in every sentinel kernels write (-1e30, FlashInfer SM120's -1e29,
# -FLT_MAX) and their base-changed images (x ln 2 or / ln 2).
EMPTY_LSE_BOUND = -1e28

# The port's stage gate: DSV41_DCP_STAGE=N says the port has reached stage N.
STAGE_ENV = "DSV41_DCP_STAGE"
COMBINE_STAGE = 3  # partial attention + LSE combine: what W > 1 needs
PREFILL_GATHER_ENV = "DSV41_DCP_PREFILL_GATHER"
