"""Where ranks run when there are fewer GPUs than ranks: the placement rule,
the headers that state it, and the skips it implies. Pure logic, so it is
checked on any host; tools/gpu_ci.py runs the suite itself on shared GPUs."""

from __future__ import annotations

import pytest
import torch

from dcpcheck.plugin.markers import _placement_skip, memory_skip
from dcpcheck.plugin.session import DcpSession
from dcpcheck.ranks.placement import Placement


@pytest.mark.parametrize(
    "world_size, gpus, backend, devices, described",
    [
        (1, 1, "nccl", [0], "cuda/nccl"),
        (2, 8, "nccl", [0, 1], "cuda/nccl"),
        (4, 4, "nccl", [0, 1, 2, 3], "cuda/nccl"),
        (2, 1, "gloo", [0, 0], "cuda/gloo, 2 ranks on 1 GPU"),
        (8, 1, "gloo", [0] * 8, "cuda/gloo, 8 ranks on 1 GPU"),
        (4, 2, "gloo", [0, 1, 0, 1], "cuda/gloo, 4 ranks on 2 GPUs"),
        (8, 3, "gloo", [0, 1, 2, 0, 1, 2, 0, 1], "cuda/gloo, 8 ranks on 3 GPUs"),
    ],
)
def test_rank_r_runs_on_gpu_r_mod_n_and_nccl_only_without_sharing(world_size, gpus, backend, devices, described):
    placement = Placement("cuda", world_size, gpus)
    assert placement.backend == backend
    assert [placement.device(r) for r in range(world_size)] == [torch.device("cuda", d) for d in devices]
    assert placement.describe() == described
    assert placement.ranks_per_gpu == max(devices.count(d) for d in set(devices))


def test_cpu_ranks_use_gloo_and_share_nothing():
    placement = Placement("cpu", 4)
    assert (placement.backend, placement.describe(), placement.shares_gpus) == ("gloo", "cpu/gloo", False)
    assert placement.device(3) == torch.device("cpu")


def test_a_cuda_placement_without_a_gpu_is_refused():
    with pytest.raises(ValueError, match="at least one visible GPU"):
        Placement("cuda", 2, 0)


def _session(gpus: int, *, sharing: bool = True, sizes=(1, 2, 4, 8), device_type: str = "cuda") -> DcpSession:
    return DcpSession(
        "port", None, device_type, sizes, 60.0, 240.0, 0, None, gpus=gpus if device_type == "cuda" else 0,
        gpu_sharing=sharing,
    )  # fmt: skip


def test_the_header_names_the_backend_of_every_world_size():
    assert _session(8).describe_devices() == "cuda/nccl"
    assert _session(1).describe_devices() == (
        "cuda/nccl at W=1; cuda/gloo, 2 ranks on 1 GPU at W=2; cuda/gloo, 4 ranks on 1 GPU at W=4; "
        "cuda/gloo, 8 ranks on 1 GPU at W=8"
    )
    assert _session(0, device_type="cpu").describe_devices() == "cpu/gloo"


def test_sharing_off_refuses_world_sizes_above_the_gpu_count():
    session = _session(2, sharing=False)
    assert session.placement_refused(2) is None
    assert session.placement_refused(4) == "W=4 needs 4 GPUs (one per rank) with --gpu-sharing off; this host has 2"
    assert session.describe_devices() == "cuda/nccl"
    assert _session(2).placement_refused(4) is None


class _Item:
    def __init__(self, *markers):
        self.markers = {marker.name: marker for marker in markers}

    def get_closest_marker(self, name):
        return self.markers.get(name)


def test_a_test_that_needs_nccl_skips_where_ranks_share_a_gpu_saying_why():
    item = _Item(pytest.mark.nccl.mark)
    reason = _placement_skip(item, _session(1), 4)
    assert reason.startswith("needs NCCL between the ranks; at W=4 they run cuda/gloo, 4 ranks on 1 GPU")
    assert "CUDA graphs cannot capture gloo collectives" in reason
    assert _placement_skip(item, _session(4), 4) is None
    assert _placement_skip(item, _session(0, device_type="cpu"), 4) is None


def test_a_test_is_skipped_when_the_ranks_sharing_a_gpu_would_not_fit():
    assert memory_skip(12, Placement("cuda", 8, 1), 139.8) is None  # 8 x 13 GiB on an H200
    assert memory_skip(12, Placement("cuda", 8, 1), 80) == (
        "needs 12 GiB per rank (+1 GiB CUDA context); at W=8 (cuda/gloo, 8 ranks on 1 GPU) a GPU would hold "
        "104 GiB, above 85% of its 80 GiB"
    )
    assert memory_skip(12, Placement("cuda", 8, 8), 80) is None  # one rank per GPU
