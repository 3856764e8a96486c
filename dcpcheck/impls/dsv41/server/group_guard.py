"""The layer's data collectives must go over its DCP coordinator's ``device_group``.

vLLM 0.33.0's ``GroupCoordinator`` (``distributed/parallel_state.py``) keeps
two process groups: its ``__init__`` makes a ``device_group`` of the server's
backend (NCCL on CUDA) and a ``cpu_group`` of gloo beside it. Its tensor
collectives (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``gather``,
``broadcast``) go through its device communicator, whose ``torch.distributed``
calls name ``device_group`` (``device_communicators/base_device_communicator.py``),
and vLLM's a2a combine (``v1/attention/ops/dcp.py`` ``dcp_a2a_lse_reduce``)
calls ``all_to_all_single`` on ``device_group`` itself; the ``cpu_group`` is
for barriers and pickled objects (``barrier``, ``broadcast_object``,
``send_object`` / ``recv_object``, ``cpu_all_reduce_``). A data collective
issued on the ``cpu_group`` still gives the right numbers over gloo, but on an
NCCL server it is staged through the host and cannot be captured in a CUDA
graph. Here both groups are gloo (CPU, or W > 1 ranks sharing one GPU), so only
the group object tells them apart: the ranks make the two distinct
(``dcpcheck/ranks``), and each of ``torch.distributed``'s data collectives
raises :class:`WrongGroupError` when it is handed a coordinator's ``cpu_group``
outside the coordinator's own cpu-group methods.

The check wraps the names of the ``torch.distributed`` package, which is how
vLLM and the port call them (``dist.all_to_all_single``, ``torch.distributed.
all_gather_into_tensor``); ``torch.distributed``'s own object collectives
call its module's functions directly and are not seen.
"""

from __future__ import annotations

import functools
import inspect
import sys
from pathlib import Path

import torch.distributed as dist

# torch.distributed's collectives that move tensor data.
DATA_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
)
# GroupCoordinator's methods that use its cpu_group by design (parallel_state.py): not checked inside them.
CPU_GROUP_METHODS = (
    "barrier",
    "broadcast_object",
    "broadcast_object_list",
    "send_object",
    "recv_object",
    "isend_object",
    "cpu_all_reduce_",
    "broadcast_tensor_dict",
    "send_tensor_dict",
    "isend_tensor_dict",
    "recv_tensor_dict",
    "irecv_tensor_dict",
)


class WrongGroupError(RuntimeError):
    """A data collective was issued on the DCP coordinator's ``cpu_group``."""


# id(cpu_group) -> (the group, the coordinator's unique_name): the groups no data collective may use.
_CPU_GROUPS: dict[int, tuple[object, str]] = {}
_inside_cpu_group_method = [0]


def guard(coordinator) -> None:
    """Data collectives on ``coordinator.cpu_group`` raise from now on, but inside its cpu-group methods."""
    if coordinator.cpu_group is coordinator.device_group:
        raise ValueError(
            f"the DCP group's cpu_group is its device_group ({coordinator.unique_name}): vLLM's GroupCoordinator "
            "keeps two distinct groups (distributed/parallel_state.py GroupCoordinator.__init__); a group of "
            "dcpcheck/ranks makes its cpu_group with torch.distributed.new_group(backend='gloo')"
        )
    _install()
    _CPU_GROUPS[id(coordinator.cpu_group)] = (coordinator.cpu_group, coordinator.unique_name)
    for name in CPU_GROUP_METHODS:
        method = getattr(coordinator, name, None)
        if callable(method):
            setattr(coordinator, name, _on_cpu_group_by_design(method))


def _on_cpu_group_by_design(method):
    @functools.wraps(method)
    def call(*args, **kwargs):
        _inside_cpu_group_method[0] += 1
        try:
            return method(*args, **kwargs)
        finally:
            _inside_cpu_group_method[0] -= 1

    return call


@functools.cache
def _install() -> None:
    """Wrap each data collective of the ``torch.distributed`` package once per process."""
    for name in DATA_COLLECTIVES:
        collective = getattr(dist, name, None)
        if callable(collective):
            setattr(dist, name, _checked(collective, name))


def _checked(collective, name: str):
    signature = inspect.signature(collective)

    @functools.wraps(collective)
    def call(*args, **kwargs):
        group = signature.bind(*args, **kwargs).arguments.get("group")
        known = _CPU_GROUPS.get(id(group)) if group is not None else None
        if known is not None and known[0] is group and not _inside_cpu_group_method[0]:
            raise WrongGroupError(_message(name, known[1], sys._getframe(1)))
        return collective(*args, **kwargs)

    return call


def _message(name: str, coordinator_name: str, caller) -> str:
    where = Path(caller.f_code.co_filename)
    shown = "/".join(where.parts[where.parts.index("vllm") :]) if "vllm" in where.parts else where.name
    return (
        f"torch.distributed.{name} issued on the DCP GroupCoordinator's cpu_group ({coordinator_name}), not its "
        f"device_group, by {caller.f_code.co_name} ({shown}:{caller.f_lineno}): vLLM's GroupCoordinator "
        "(distributed/parallel_state.py) sends data over device_group; its cpu_group is gloo, so on an NCCL server "
        "this collective is staged through the host and cannot be captured in a CUDA graph"
    )
