"""What the end-to-end tests share: DeepSeek-V4.1's own topologies and the
requests of their traces (the check itself: :mod:`dcpcheck.checks.serving_trace`)."""

from __future__ import annotations

import dataclasses

from dcpcheck.scenarios.topology import Dsv41Topology
from dcpcheck.scenarios.trace import RequestSpec

# The same events in a quarter of the rows, for the DSV4.1 topologies (a real
# port's stage-3 path runs vLLM's combine kernels, whose cost under the
# Triton interpreter grows with every row): a prompt prefilled over three
# steps, spec decode, a tiny prompt, states completed mid-prefill, a late join.
DSV41_REQUESTS = [
    RequestSpec(uid=0, arrival=0, prompt_len=72, decode_steps=2),
    RequestSpec(uid=1, arrival=0, prompt_len=13, decode_steps=3, tokens_per_decode=3),
    RequestSpec(uid=2, arrival=1, prompt_len=3, decode_steps=3),
    RequestSpec(uid=3, arrival=1, prompt_len=29, decode_steps=1),
    RequestSpec(uid=4, arrival=4, prompt_len=21, decode_steps=1),
]
DSV41_TOKEN_BUDGET = 32
# The same, with a prompt long enough that a 64-token interleave hands it to
# the next rank and back (150 tokens: 64 on one rank, 64 on the next, 22 back).
SWEEP_REQUESTS = [dataclasses.replace(DSV41_REQUESTS[0], prompt_len=150), *DSV41_REQUESTS[1:]]
SWEEP_TOKEN_BUDGET = 64
# SWA only, then two KV groups: a ratio-2 kv source and index source read by
# the next layer, and a ratio-1 one.
DSV41_TOPOLOGY = Dsv41Topology(compress_ratios=(0, 2, 2, 1), kv_source_layer_ids=(1, 3), index_source_layer_ids=(1, 3))
# Ratio 1 only: a kv source and index source, and a layer reading both.
DSV41_RATIO1_TOPOLOGY = Dsv41Topology(compress_ratios=(0, 1, 1), kv_source_layer_ids=(1,), index_source_layer_ids=(1,))
