"""The DCP group the port's layer is handed: the tree's own vLLM ``GroupCoordinator``
(``distributed/parallel_state.py``) over the test's process group.

Its collectives are the tree's: ``GroupCoordinator.all_gather`` /
``reduce_scatter`` / ... into a device communicator of the tree
(``distributed/device_communicators``), whose ``all_gather`` moves the rank
blocks onto the gathered dim. The communicator is the one the tree's platform
names (``current_platform.get_device_communicator_cls()``) where its
collectives are ``torch.distributed`` calls on the groups it is given, so they
run over the test's gloo group; elsewhere (CUDA's ``CudaCommunicator`` goes
through pynccl and custom all-reduce, which need NCCL) the tree's
``DeviceCommunicatorBase``, the class every communicator derives from.

The object is built without ``GroupCoordinator.__init__``: that ``__init__``
makes its groups itself with ``torch.distributed.new_group`` (a collective of
the whole world; NCCL refuses two ranks on one GPU) and builds the platform's
communicator. The attributes it sets are set here, from the test's
``DcpGroup`` and the tree's own helpers, as the tree's
``StatelessGroupCoordinator`` does (``GroupCoordinator.__init__`` notes that
subclasses replicate it without calling it). Its ``cpu_group`` and
``device_group`` are the DcpGroup's two, distinct as that ``__init__`` makes
them (a gloo ``cpu_group`` beside the device group): a data collective issued
on the ``cpu_group`` fails the case (:mod:`.group_guard`).

Each collective of the coordinator counts on the ``DcpGroup``
(``collective_calls``: the stage gate must refuse before the first one)
before the tree's method runs; a test that hands the implementation an
observing wrapper of its group (``CountingGroup``) gets a coordinator of its
own that tells the wrapper of each all-gather. A group over no ``DcpGroup`` of
W > 1 (W = 1: the layer asks for none; dcpcheck's probes' local stand-ins) is
handed over as it is.
"""

from __future__ import annotations

import collections
import functools
import importlib
import inspect
import sys
import weakref
from dataclasses import dataclass

import torch.distributed as dist

from dcpcheck.group import DcpGroup
from dcpcheck.impls.dsv41.server import group_guard

PARALLEL_STATE = "vllm.distributed.parallel_state"
COORDINATOR_CLASS = "GroupCoordinator"
BASE_COMMUNICATOR = "vllm.distributed.device_communicators.base_device_communicator.DeviceCommunicatorBase"
# The tree's communicators whose collectives are torch.distributed calls on the groups they are given
# (the CPU one without its shared-memory path, which only tp and pp groups take).
OVER_TORCH_DISTRIBUTED = (
    BASE_COMMUNICATOR,
    "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator",
)
# GroupCoordinator's methods that communicate: each counts once on the DcpGroup (an outer call only).
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gatherv",
    "reduce_scatter",
    "reduce_scatterv",
    "reduce_scatterv_into_output",
    "gather",
    "broadcast",
    "broadcast_object",
    "broadcast_object_list",
    "broadcast_tensor_dict",
    "send_object",
    "recv_object",
    "isend_object",
    "send_tensor_dict",
    "isend_tensor_dict",
    "recv_tensor_dict",
    "irecv_tensor_dict",
    "send",
    "recv",
    "barrier",
    "cpu_all_reduce_",
)


@dataclass(frozen=True)
class TreeCoordinator:
    """The tree's ``GroupCoordinator`` class and the communicator class dcpcheck builds it with."""

    coordinator_cls: type
    communicator_cls: type
    platform_communicator: str  # the qualname the tree's platform names

    def describe(self) -> str:
        """What runs, as the manifest line says it."""
        module = self.communicator_cls.__module__.removeprefix("vllm.").replace(".", "/") + ".py"
        name = self.communicator_cls.__name__
        if f"{self.communicator_cls.__module__}.{name}" == self.platform_communicator:
            which = "the tree's platform's"
        else:
            platform = self.platform_communicator.rpartition(".")[2]
            which = f"in place of the platform's {platform}, which cannot run over gloo"
        return f"collectives through {module} {name}, {which}; over the test's process group"


@functools.cache
def tree_coordinator() -> TreeCoordinator | None:
    """The tree's classes (the ``vllm`` the port is loaded from), or None where it has no ``GroupCoordinator``."""
    parallel_state = importlib.import_module(PARALLEL_STATE)
    coordinator_cls = getattr(parallel_state, COORDINATOR_CLASS, None)
    if coordinator_cls is None:
        return None
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import resolve_obj_by_qualname

    named = current_platform.get_device_communicator_cls()
    communicator_cls = resolve_obj_by_qualname(named if named in OVER_TORCH_DISTRIBUTED else BASE_COMMUNICATOR)
    return TreeCoordinator(coordinator_cls, communicator_cls, named)


# id(DcpGroup) -> (the group, its coordinator): one per group, as vLLM has one DCP group a process.
_COORDINATORS: dict[int, tuple[DcpGroup, object]] = {}
# id(a test's wrapper of a DcpGroup) -> its coordinator, which holds the wrapper (so the id stays its own).
_WRAPPER_COORDINATORS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _wrapper_chain(group) -> list | None:
    """``group`` and each group it wraps (``wrapped``: a test's observing wrapper, as
    :class:`dcpcheck.checks.collectives.CountingGroup`), down to a DcpGroup; None where there is none."""
    chain = [group]
    while not isinstance(chain[-1], DcpGroup):
        inner = getattr(type(chain[-1]), "wrapped", None) and chain[-1].wrapped
        if inner is None:
            return None
        chain.append(inner)
    return chain


def layer_group(group):
    """What the layer's ``get_dcp_group()`` returns for the test's ``group``: the tree's
    ``GroupCoordinator`` over its DcpGroup's process groups, the wrappers between told of its all-gathers."""
    chain = _wrapper_chain(group)
    if chain is None or chain[-1].world_size == 1 or chain[-1].device_group is None:
        return group
    tree = tree_coordinator()
    if tree is None:
        return group
    if len(chain) == 1:
        known = _COORDINATORS.get(id(group))
        if known is None or known[0] is not group:
            known = (group, _coordinator(tree, chain))
            _COORDINATORS[id(group)] = known
        return known[1]
    coordinator = _WRAPPER_COORDINATORS.get(id(group))
    if coordinator is None:
        coordinator = _coordinator(tree, chain)
        _WRAPPER_COORDINATORS[id(group)] = coordinator
    return coordinator


def _coordinator(tree: TreeCoordinator, chain: list):
    """The tree's ``GroupCoordinator`` over the process groups of the DcpGroup ending ``chain``,
    each attribute as its ``__init__`` sets it."""
    group = chain[-1]
    from vllm.distributed import utils as dist_utils
    from vllm.platforms import current_platform

    parallel_state = sys.modules[tree.coordinator_cls.__module__]
    coordinator = tree.coordinator_cls.__new__(tree.coordinator_cls)
    coordinator.unique_name = parallel_state._get_unique_name("dcp")
    parallel_state._register_group(coordinator)  # the custom-op collectives find the group by its name
    coordinator.rank = dist.get_rank()
    coordinator.local_rank = coordinator.device_index = group.local_rank
    coordinator.cpu_timeout = dist_utils.get_cpu_distributed_timeout_or_none()
    coordinator.ranks = dist.get_process_group_ranks(group.device_group)
    coordinator.world_size = group.world_size
    coordinator.rank_in_group = group.rank_in_group
    coordinator.group_ranks = [coordinator.ranks]
    coordinator.torch_distributed_backend = dist.get_backend(group.device_group)
    coordinator.cpu_group = group.cpu_group
    coordinator.device_group = group.device_group
    coordinator.device = group.device  # the test's device (two ranks may share one GPU)
    coordinator.use_device_communicator = True
    coordinator.device_communicator = tree.communicator_cls(
        cpu_group=group.cpu_group,
        device=group.device,
        device_group=group.device_group,
        unique_name=coordinator.unique_name,
        use_all2all=False,
    )
    coordinator.mq_broadcaster = None
    coordinator.use_custom_op_call = current_platform.is_tpu() or current_platform.use_custom_op_collectives()
    coordinator.use_cpu_custom_send_recv = current_platform.is_cpu() and getattr(
        coordinator.device_communicator, "supports_tensor_dict", False
    )
    coordinator._pending_isends = collections.deque()
    group_guard.guard(coordinator)
    _count_collectives(coordinator, chain)
    return coordinator


def _count_collectives(coordinator, chain: list) -> None:
    """Each of the coordinator's collectives counts on the DcpGroup ending ``chain`` (once, however
    it nests), each all-gather is told to the wrappers before it (``observe_all_gather``), then it runs."""
    group, observers = chain[-1], [wrapper.observe_all_gather for wrapper in chain[:-1]]
    depth = [0]

    def counting(method, name):
        signature = inspect.signature(method)

        @functools.wraps(method)
        def call(*args, **kwargs):
            if depth[0] == 0:
                group.collective_calls += 1
                if name == "all_gather" and observers:
                    bound = signature.bind(*args, **kwargs)
                    bound.apply_defaults()
                    for observe in observers:
                        observe(*bound.args)
            depth[0] += 1
            try:
                return method(*args, **kwargs)
            finally:
                depth[0] -= 1

        return call

    for name in COLLECTIVES:
        method = getattr(coordinator, name, None)
        if callable(method):
            setattr(coordinator, name, counting(method, name))
