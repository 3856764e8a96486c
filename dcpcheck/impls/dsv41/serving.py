"""How the tree serves the port, asked of the tree's own code: the compressed
write side (its DSV4.1 metadata builder), the interleave unit of the port's
read side, and where the sliding-window cache lives under DCP.

Each question is a small probe run once, at W = 2, compress ratio 2 and a
2-token ``--cp-kv-cache-interleave-size`` (one state per rank in turn, the
smallest case where tokens and states differ). Its answer decides which
findings the checks report and which write side the driver uses; vLLM's own
DCP writer (``get_compressed_slot_mapping`` called with ``dcp_world_size``
and ``cp_interleave``, as vLLM's indexer calls it) is the reference placement.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from contextlib import contextmanager, nullcontext

import torch

from dcpcheck.impls.dsv41.combine import run_step
from dcpcheck.impls.dsv41.kernel_calls import kernel_call_finding
from dcpcheck.impls.dsv41.layer import LayerSpec, attention_base, build_port_layer, index_topk
from dcpcheck.impls.dsv41.tree import BUILDER_CLASS, PortTree, patched
from dcpcheck.scenarios.topology import Dsv41Topology

# The probes' names: each probe's check fails with "NAME: finding".
COMPRESSED_WRITER = "compressed writer"
READ_UNIT = "read side's interleave unit"
SWA_CACHE_PLACEMENT = "sliding-window cache placement"
FLASHINFER_KERNEL_CALL = "FlashInfer kernel call"
DCP_REFUSAL = "indexer's DCP refusal"
HEAD_COUNTS = "DCP head counts"
COMBINE_CONTEXT = "combine launch context"

PROBE_WORLD_SIZE = 2
PROBE_RATIO = 2
PROBE_INTERLEAVE_TOKENS = 2
PROBE_PAGE_TOKENS = 8
PROBE_TOKENS = 32
PROBE_TABLE_WIDTH = 8  # wider than a rank's pages: the columns after them are the null page, as vLLM's rows


def build_compressed_metadata(
    tree: PortTree,
    *,
    rho: int,
    tokens_per_page: int,
    token_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    num_actual_tokens: int,
    topk_tokens: int,
):
    """The step's ``DeepseekV4FlashMLAMetadata`` from the tree's metadata
    builder's ``build`` (its compressed slot mapping included). The builder's
    state is what its ``__init__`` derives from the KV-cache spec; that
    ``__init__`` needs vLLM's runner, so it is set here."""
    builder_cls = getattr(tree.module({}), BUILDER_CLASS)
    builder = builder_cls.__new__(builder_cls)
    rows = max(int(token_slots.numel()), 1)
    builder.compress_ratio = rho
    builder.pcp_size, builder.pcp_rank = 1, 0
    builder.topk_tokens = topk_tokens
    builder.kv_cache_spec = types.SimpleNamespace(
        block_size=tokens_per_page, num_states=tokens_per_page // rho, tokens_per_state=rho
    )
    builder.req_id_per_token_buffer = torch.empty(rows, dtype=torch.int32, device=token_slots.device)
    builder.compressed_slot_mapping_buffer = torch.empty(rows, dtype=torch.int64, device=token_slots.device)
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    common = types.SimpleNamespace(
        num_reqs=int(seq_lens.numel()),
        num_actual_tokens=num_actual_tokens,
        max_query_len=int(query_lens.max()) if query_lens.numel() else 0,
        max_seq_len=int(seq_lens.max()) if seq_lens.numel() else 0,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        slot_mapping=token_slots,
        block_table_tensor=block_table,
        token_to_req_indices=lambda buffer: token_to_req,
    )
    return builder_cls.build(builder, 0, common)


def compressed_cache_spec(tree: PortTree, *, rho: int, tokens_per_page: int):
    """The tree's ``DeepseekV4Attention.get_kv_cache_spec`` (``models/deepseek_v41/attention.py``) of a kv-source
    layer of compress ratio ``rho``, run on what that method reads (its page in tokens is
    ``cache_config.block_size``); bf16 rows: the cache dtype decides the page's bytes, not its states."""
    cls = getattr(tree.module({}), tree.spec.cls)
    holder = types.SimpleNamespace(
        is_kv_source=True,
        kv_cache_dtype="auto",
        kv_cache_torch_dtype=torch.bfloat16,
        head_dim=512,
        compress_ratio=rho,
    )
    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=tokens_per_page))
    return attention_base(cls).get_kv_cache_spec(holder, config)


def block_table_width(spec, *, max_model_len: int, dcp_world_size: int) -> int:
    """A rank's block-table row for a KV group of ``spec``, as vLLM's runner sizes it: the spec's own
    ``max_num_blocks_per_req`` (``v1/kv_cache_interface.py``; ``AttentionSpec``'s is
    ``cdiv(max_len, block_size * W)`` where the cache is DCP-sharded) padded by ``get_block_table_width``
    (``v1/worker/block_table.py``, to a 128-token multiple), as ``gpu_model_runner.py``
    ``may_reinitialize_input_batch`` and ``MultiGroupBlockTable.__init__`` do."""
    from vllm.v1.worker.block_table import get_block_table_width

    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(decode_context_parallel_size=dcp_world_size))
    return get_block_table_width(spec.max_num_blocks_per_req(config, max_model_len), spec.block_size)


@contextmanager
def _recording_writer_calls(tree: PortTree):
    """The keyword arguments of every ``get_compressed_slot_mapping`` call the builder makes."""
    builder_cls = getattr(tree.module({}), BUILDER_CLASS)
    build_module = sys.modules[builder_cls.build.__module__]
    writer = getattr(build_module, "get_compressed_slot_mapping", None)
    calls: list[dict] = []
    if writer is None:
        yield calls
        return

    def recorded(*args, **kwargs):
        calls.append(kwargs)
        return writer(*args, **kwargs)

    with patched(build_module, get_compressed_slot_mapping=recorded):
        yield calls


def probe_device() -> torch.device:
    """Where the probes run: vLLM's kernels are compiled for the GPU where there is one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _probe_request(rank: int):
    """One request of PROBE_TOKENS tokens on ``rank``: positions, its rows, and a block table
    whose first pages are the rank's (pages 1, 2, ...), the rest the null page 0."""
    device = probe_device()
    positions = torch.arange(PROBE_TOKENS, device=device)
    token_to_req = torch.zeros(PROBE_TOKENS, dtype=torch.int32, device=device)
    block_table = torch.zeros((1, PROBE_TABLE_WIDTH), dtype=torch.int32, device=device)
    local_pages = -(-PROBE_TOKENS // (PROBE_PAGE_TOKENS * PROBE_WORLD_SIZE))
    block_table[0, :local_pages] = torch.arange(1, local_pages + 1, device=device) + 10 * rank
    return positions, token_to_req, block_table


def _dcp_writer_slots(vllm, rank: int) -> torch.Tensor:
    """vLLM's DCP placement of the probe's states on ``rank``: [PROBE_TOKENS] slots, -1 where no state."""
    positions, token_to_req, block_table = _probe_request(rank)
    return vllm.slot_mapping(
        positions,
        token_to_req,
        block_table,
        rho=PROBE_RATIO,
        bs=PROBE_PAGE_TOKENS // PROBE_RATIO,
        world_size=PROBE_WORLD_SIZE,
        rank=rank,
        interleave=PROBE_INTERLEAVE_TOKENS // PROBE_RATIO,
    )


def writer_finding(tree: PortTree, vllm) -> str | None:
    """Does the tree's builder place compressed states where vLLM's DCP writer does? None if it does."""
    wrong = 0
    written = 0
    with _recording_writer_calls(tree) as calls:
        for rank in range(PROBE_WORLD_SIZE):
            positions, token_to_req, block_table = _probe_request(rank)
            expected = _dcp_writer_slots(vllm, rank)
            token_slots = vllm.token_slots(
                positions,
                token_to_req,
                block_table,
                tokens_per_page=PROBE_PAGE_TOKENS,
                world_size=PROBE_WORLD_SIZE,
                rank=rank,
                token_interleave=PROBE_INTERLEAVE_TOKENS,
            )
            metadata = build_compressed_metadata(
                tree,
                rho=PROBE_RATIO,
                tokens_per_page=PROBE_PAGE_TOKENS,
                token_slots=token_slots,
                query_start_loc=torch.tensor([0, PROBE_TOKENS], dtype=torch.int32, device=positions.device),
                seq_lens=torch.tensor([PROBE_TOKENS], dtype=torch.int32, device=positions.device),
                block_table=block_table.clone(),
                token_to_req=token_to_req,
                num_actual_tokens=PROBE_TOKENS,
                topk_tokens=0,
            )
            actual = metadata.slot_mapping[:PROBE_TOKENS]
            wrong += int((actual != expected).sum())
            written += int((expected >= 0).sum())
    if not wrong:
        return None
    build = getattr(tree.module({}), BUILDER_CLASS).build
    where = f"{build.__module__.replace('.', '/')}.py:{build.__qualname__}"
    if calls and not any("dcp_world_size" in call for call in calls):
        how = "passes no dcp_world_size to get_compressed_slot_mapping"
    else:
        how = "places compressed states elsewhere than vLLM's DCP writer"
    return (
        f"the write side of the DCP2 port is missing: {where} {how} (W={PROBE_WORLD_SIZE}, compress ratio "
        f"{PROBE_RATIO}, a {PROBE_INTERLEAVE_TOKENS}-token interleave: {wrong} of {PROBE_TOKENS * PROBE_WORLD_SIZE} "
        f"token rows get another slot; vLLM's DCP writer writes {written} states)"
    )


def reader_finding(build_layer, vllm) -> str | None:
    """Does the port's read side (``_compressed_topk_to_slots``) read each state where vLLM's DCP
    writer put it? ``build_layer(rank, rho)``: a layer of the probe's layout (asked at PROBE_RATIO). None if it does."""
    num_states = PROBE_TOKENS // PROBE_RATIO
    problems = []
    for rank in range(PROBE_WORLD_SIZE):
        _, _, block_table = _probe_request(rank)
        written = _dcp_writer_slots(vllm, rank)
        # State c is written by its last token, position (c + 1) * ratio - 1 (-1: on another rank).
        state_slots = written[PROBE_RATIO - 1 :: PROBE_RATIO]
        layer = build_layer(rank, PROBE_RATIO)
        device = block_table.device
        # One row per state, each asking for that state alone: the compacted
        # output then says which slot the read side gives each state.
        topk = torch.full((num_states, layer.topk_indices_buffer.shape[1]), -1, dtype=torch.int32, device=device)
        topk[:, 0] = torch.arange(num_states, device=device)
        try:
            slots, lens = layer._compressed_topk_to_slots(
                topk,
                torch.zeros(num_states, dtype=torch.int32, device=device),
                block_table,
                PROBE_PAGE_TOKENS // PROBE_RATIO,
                torch.ones(num_states, dtype=torch.bool, device=device),
            )
        except (AssertionError, ValueError, RuntimeError) as exc:
            problems.append(f"rank {rank} raised {type(exc).__name__}: {exc}")
            continue
        read = torch.where(lens > 0, slots[:, 0].long(), -1)
        misplaced = int((read != state_slots).sum())
        if misplaced:
            problems.append(
                f"rank {rank} reads {misplaced} of the {num_states} states elsewhere than they were written"
            )
    if not problems:
        return None
    return (
        f"at W={PROBE_WORLD_SIZE}, compress ratio {PROBE_RATIO} and a {PROBE_INTERLEAVE_TOKENS}-token interleave "
        f"(one state per rank in turn), each of {num_states} states asked alone: " + "; ".join(problems)
    )


def swa_finding(tree: PortTree) -> str | None:
    """Is the tree's sliding-window cache stored as the port reads it (replicated on every DCP rank)?"""
    cls = getattr(tree.module({}), tree.spec.cls)
    swa_cls = sys.modules[attention_base(cls).__module__].DeepseekV4SWACache
    cache = swa_cls.__new__(swa_cls)
    cache.__dict__.update(
        bounded_replay=False,
        block_size=32,
        head_dim=512,
        dtype=torch.bfloat16,
        window_size=128,
        cache_config=types.SimpleNamespace(cache_dtype="auto"),
        packed_bytes_per_token=584,
        packed_page_alignment=576,
        packed_block_stride_alignment=None,
    )
    spec = swa_cls.get_kv_cache_spec(cache, None)
    if not getattr(spec, "dcp_sharded", False):
        return None
    return (
        f"the sliding-window cache is DCP-sharded in the tree: {swa_cls.__module__}.{swa_cls.__name__}."
        f"get_kv_cache_spec builds a {type(spec).__name__} with dcp_sharded=True (AttentionSpec's default, "
        "vllm/v1/kv_cache_interface.py), which vLLM 0.33.0 refuses under DCP (SlidingWindowSpec."
        "max_memory_usage_bytes: 'DCP not support sliding window'), while the port reads the window replicated "
        "(_run_sm120_dcp attends it on DCP rank 0; SWA-only layers keep the DCP1 path)"
    )


# The interleaves the e2e sweep serves at (vLLM's default of 1 token, the
# topology trace's 2, a 64-token page and NIXL's 128) at both compressed ratios.
REFUSAL_GRID = tuple((ratio, tokens) for ratio in (1, 2) for tokens in (1, 2, 64, 128))


def indexer_dcp_refusal(tree: PortTree, *, ratio: int, interleave_tokens: int, world_size: int) -> str | None:
    """What the tree's DSV4.1 indexer metadata builder says of serving an index source of
    compress ratio ``ratio`` under DCP ``world_size`` with a ``--cp-kv-cache-interleave-size``
    of ``interleave_tokens``: its ``__init__``'s NotImplementedError, or None if it builds.
    The builder is the one the tree's ``DeepseekV4IndexerCache.get_attn_backend`` picks
    without sparse logits; the runner fields its ``__init__`` reads are stood in."""
    cls = getattr(tree.module({}), tree.spec.cls)
    attention_module = sys.modules[attention_base(cls).__module__]
    builder_cls = attention_module.DeepseekV41IndexerBackend.get_builder_cls()
    builder_module = sys.modules[builder_cls.__init__.__module__]
    ns = types.SimpleNamespace
    config = ns(
        scheduler_config=ns(max_num_batched_tokens=64, max_num_seqs=8),
        parallel_config=ns(
            decode_context_parallel_size=world_size,
            tensor_parallel_size=world_size,
            prefill_context_parallel_size=1,
            cp_kv_cache_interleave_size=interleave_tokens,
        ),
        speculative_config=None,
        num_speculative_tokens=0,
        model_config=ns(max_model_len=4096),
        attention_config=ns(sparse_mla_prefill_workspace_factor=5, resolve_indexer_kv_dtype=lambda default: default),
    )
    spec = attention_module.MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=132, dtype=torch.uint8, tokens_per_state=ratio
    )
    stand_ins = {"get_dcp_group": lambda: ns(rank_in_group=0), "num_compute_units": lambda index: 1}
    with patched(builder_module, **stand_ins):
        try:
            builder_cls(spec, ["indexer"], config, torch.device("cpu"), block_table_width=8)
        except NotImplementedError as exc:
            return f"{builder_cls.__module__}.{builder_cls.__qualname__}.__init__: {exc}"
    return None


def refusal_finding(tree: PortTree) -> str | None:
    """Does the tree's indexer refuse DCP exactly where dcpcheck's model of vLLM
    (:meth:`Dsv41Topology.dcp_refusal`, which decides the e2e sweep's skips) does? None if it does."""
    disagreements = []
    for ratio, tokens in REFUSAL_GRID:
        model = Dsv41Topology((ratio,), (0,), (0,)).dcp_refusal(tokens)
        tree_answer = indexer_dcp_refusal(tree, ratio=ratio, interleave_tokens=tokens, world_size=PROBE_WORLD_SIZE)
        if (model is None) != (tree_answer is None):
            said = "refuses" if tree_answer else "serves"
            disagreements.append(f"ratio {ratio}, {tokens}-token interleave: the tree {said} it, the model does not")
    if not disagreements:
        return None
    return (
        f"at W={PROBE_WORLD_SIZE}, dcpcheck's model of vLLM's DCP refusal (dcpcheck/scenarios/topology.py) is not "
        "the tree's: " + "; ".join(disagreements)
    )


# One gathered prefill step over layers of compress ratios 1, 2, 1 (three kv
# sources: two KV groups, so vLLM hands the layers two metadata objects, the
# first one twice), one 40-token prefill request on 8-state pages.
GEOMETRY_STACK = (1, 2, 1)
GEOMETRY_SEQ_LEN = 40
GEOMETRY_PAGE_STATES = 8
GEOMETRY_ROWS = 4


class _HostReadCounted(torch.Tensor):
    """A metadata tensor that counts the reads bringing its values to the host
    (each a device-to-host sync on CUDA); its slices count into the same total."""

    reads = 0
    HOST_READS = (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy)

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        if func in cls.HOST_READS:
            cls.reads += 1
        return super().__torch_function__(func, types_, args, kwargs or {})


class _LocalAllGather:
    """A DCP group whose all-gather stacks W copies of this rank's part: the
    gather's collective, for a single-process measurement of what surrounds it."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return torch.cat([tensor] * self.world_size, dim=dim)


def gather_geometry_reads(build_layer, topk_width: int) -> tuple[int, int]:
    """The cost of the port's prefill-gather geometry across KV groups:
    ``_dcp_prefill_gather`` of each layer of :data:`GEOMETRY_STACK` in one step,
    each layer given its KV group's metadata object, as vLLM's runner gives it.
    ``build_layer(rank, rho)``: a layer of the probe's layout; ``topk_width``: the top-k buffer's.
    -> (host reads of ``attn_metadata.seq_lens`` in the step, metadata objects)."""
    device = probe_device()
    metadata = {
        rho: types.SimpleNamespace(
            seq_lens=torch.tensor([GEOMETRY_SEQ_LEN], dtype=torch.int32, device=device).as_subclass(_HostReadCounted),
            block_table=torch.arange(1, PROBE_TABLE_WIDTH + 1, dtype=torch.int32, device=device).reshape(1, -1),
        )
        for rho in set(GEOMETRY_STACK)
    }
    topk = torch.full((GEOMETRY_ROWS, topk_width), -1, dtype=torch.int32, device=device)
    topk[:, 0] = 0
    cache = torch.zeros(PROBE_TABLE_WIDTH + 1, GEOMETRY_PAGE_STATES, 64, dtype=torch.bfloat16, device=device)
    layers = [build_layer(0, rho) for rho in GEOMETRY_STACK]
    # The port keeps its step cache on the class: a copy for the measurement, so real cases never see its entries.
    step_cache = getattr(type(layers[0]), "_dcp_gather_cache", None)
    keep_class_cache = (
        patched(type(layers[0]), _dcp_gather_cache=dict(step_cache)) if isinstance(step_cache, dict) else nullcontext()
    )
    _HostReadCounted.reads = 0
    with keep_class_cache:
        for rho, layer in zip(GEOMETRY_STACK, layers):
            _gather_once(layer, metadata[rho], cache, topk, device)
    return _HostReadCounted.reads, len(metadata)


def _gather_once(layer, metadata, cache, topk, device) -> None:
    with patched(layer, dcp_group=_LocalAllGather(PROBE_WORLD_SIZE)):
        layer._dcp_prefill_gather(
            cache,
            topk,
            torch.zeros(GEOMETRY_ROWS, dtype=torch.int32, device=device),
            torch.ones(GEOMETRY_ROWS, dtype=torch.bool, device=device),
            metadata,
            0,
            1,
            GEOMETRY_PAGE_STATES,
        )


# (W, local heads, why the port must refuse it under DCP, or None: a count it serves).
# The kernel sees the W ranks' local heads gathered [rank 0 | rank 1 | ...] and
# the combine's reduce-scatter hands each rank back its slice of that order.
HEAD_COUNT_CASES = (
    (2, 8, None),
    (2, 4, "padded to 8 heads, so the gathered heads interleave padding with the ranks' heads"),
    (3, 8, "24 gathered heads, a count no sparse-MLA kernel takes"),
    (4, 64, "256 gathered heads, more than any sparse-MLA kernel takes (DSV4.1's 128 heads at TP 2 and DCP 4)"),
)


def _head_count_layer(tree: PortTree, world_size: int, local_heads: int):
    device = probe_device()
    group = types.SimpleNamespace(world_size=world_size, rank_in_group=0, device=device)
    spec = LayerSpec(
        layer_id=0,
        rho=PROBE_RATIO,
        bs=PROBE_PAGE_TOKENS // PROBE_RATIO,
        interleave=1,
        world_size=world_size,
        rank=0,
        local_heads=local_heads,
        head_dim=64,
        window=128,
        sink=torch.zeros(local_heads),
        topk_buffer=torch.full((PROBE_TOKENS, index_topk()), -1, dtype=torch.int32, device=device),
        max_num_batched_tokens=PROBE_TOKENS,
        max_model_len=4096,
    )
    return build_port_layer(tree, group, spec, backend="a2a", prefill_token_chunk=None)


def head_count_finding(tree: PortTree) -> str | None:
    """Does the port's ``__init__`` refuse exactly the DCP head counts it cannot serve
    (:data:`HEAD_COUNT_CASES`)? None if it does."""
    problems = []
    for world_size, local_heads, why_refused in HEAD_COUNT_CASES:
        try:
            _head_count_layer(tree, world_size, local_heads)
        except (NotImplementedError, ValueError) as exc:
            if why_refused is None:
                problems.append(f"refuses W={world_size} with {local_heads} local heads, a served count: {exc}")
            continue
        if why_refused:
            problems.append(f"builds a layer at W={world_size} with {local_heads} local heads ({why_refused})")
    return "; ".join(problems) or None


def kept_combine_context(build_layer):
    """The launch context two ``_run_sm120_dcp`` steps of one layer built for the ag_rs
    combine both hand ``cp_lse_ag_out_rs`` as ``ctx``; None where the steps hand no
    context or a new one each (vLLM's own callers). The steps are stage 3's
    (:func:`dcpcheck.impls.dsv41.combine.run_step`, its kernel a stand-in), the combine a
    spy that records ``ctx``: this runs on any host."""
    layer = build_layer(0, PROBE_RATIO, backend="ag_rs")
    module = sys.modules[type(layer).__module__]
    signature = inspect.signature(module.cp_lse_ag_out_rs)
    handed = []

    def combine(*args, **kwargs):
        call = signature.bind(*args, **kwargs).arguments
        handed.append(call.get("ctx"))
        out = next(iter(call.values()))
        return out[:, : out.shape[1] // PROBE_WORLD_SIZE]

    device = probe_device()
    heads = layer.n_local_heads * PROBE_WORLD_SIZE
    out = torch.zeros((1, heads, layer.head_dim), dtype=torch.bfloat16, device=device)
    lse = torch.zeros((1, heads), dtype=torch.float32, device=device)
    swa_indices = torch.full((1, 1, 1), -1, dtype=torch.int32, device=device)
    swa_lens = torch.zeros(1, dtype=torch.int32, device=device)
    with patched(module, cp_lse_ag_out_rs=combine):
        run_step(
            layer, out, lse, torch.zeros(layer.n_local_heads), swa_indices, swa_lens, _LocalAllGather(PROBE_WORLD_SIZE)
        )
    kept = len(handed) == 2 and handed[0] is not None and handed[0] is handed[1]
    return handed[0] if kept else None


def combine_context_finding(build_layer) -> str | None:
    """Can the combine launch context the port keeps across steps (:func:`kept_combine_context`)
    launch vLLM's combine kernel a second time on this host? Asked of compiled kernels
    only (a GPU); None where it can, or where no context is kept."""
    if not torch.cuda.is_available():
        return None
    import triton  # here, not at import: on CPU the adapter sets TRITON_INTERPRET before triton loads

    context = kept_combine_context(build_layer)
    if context is None:
        return None
    ops = sys.modules[type(context).__module__]
    fresh = type(context)()  # a context of the same class, never used by the layer
    out = torch.ones((4, 16, 64), dtype=torch.bfloat16, device="cuda")
    lses = torch.zeros((PROBE_WORLD_SIZE, 4, 16), dtype=torch.float32, device="cuda")
    try:
        for _ in range(2):
            ops.correct_attn_out(out.clone(), lses, 0, fresh, is_lse_base_on_e=False)
    except TypeError as exc:
        return (
            "the port keeps one CPTritonContext per layer and hands it to cp_lse_ag_out_rs as ctx= at every "
            "step (_run_sm120_dcp), and vLLM's CPTritonContext.call_kernel relaunches the combine "
            f"kernel it compiled with the non-constexpr arguments only, which Triton {triton.__version__}'s "
            f"launcher refuses: a context's second launch raises TypeError: {exc}. vLLM's own callers pass no "
            "context (a fresh one per call), so only the port meets it: every DCP layer's second ag_rs combine"
        )
    return None


class ServingFindings:
    """The probes' answers for one tree, each asked once, when first needed."""

    def __init__(self, tree: PortTree, vllm, build_layer):
        self._tree, self._vllm, self._build_layer = tree, vllm, build_layer

    @functools.cached_property
    def compressed_writer(self) -> str | None:
        return writer_finding(self._tree, self._vllm)

    @functools.cached_property
    def read_unit(self) -> str | None:
        return reader_finding(self._build_layer, self._vllm)

    @functools.cached_property
    def swa_placement(self) -> str | None:
        return swa_finding(self._tree)

    @functools.cached_property
    def kernel_call(self) -> str | None:
        return kernel_call_finding(self._tree, probe_device())

    @functools.cached_property
    def gather_geometry_cost(self) -> str:
        """What the prefill gather's geometry costs across KV groups (a measured cost, never a failure)."""
        if not callable(getattr(self._build_layer(0, 1), "_dcp_prefill_gather", None)):
            return "not measured (the layer has no _dcp_prefill_gather)"
        try:
            reads, objects = gather_geometry_reads(self._build_layer, index_topk())
        except Exception as exc:  # noqa: BLE001 - a port with another gather signature: the header says so
            return f"not measured (_dcp_prefill_gather raised {type(exc).__name__}: {exc})"
        return (
            f"{reads} host reads of attn_metadata.seq_lens (a sync each on CUDA) in one gathered prefill step "
            f"over layers of compress ratios {', '.join(map(str, GEOMETRY_STACK))}, where the runner gives "
            f"{objects} metadata objects"
        )

    @functools.cached_property
    def head_counts(self) -> str | None:
        return head_count_finding(self._tree)

    @functools.cached_property
    def combine_context(self) -> str | None:
        return combine_context_finding(self._build_layer)

    @functools.cached_property
    def dcp_refusal(self) -> str | None:
        return refusal_finding(self._tree)

    def by_name(self) -> dict[str, str | None]:
        return {
            DCP_REFUSAL: self.dcp_refusal,
            HEAD_COUNTS: self.head_counts,
            COMBINE_CONTEXT: self.combine_context,
            COMPRESSED_WRITER: self.compressed_writer,
            READ_UNIT: self.read_unit,
            SWA_CACHE_PLACEMENT: self.swa_placement,
            FLASHINFER_KERNEL_CALL: self.kernel_call,
        }
