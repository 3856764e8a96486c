"""The xdist groups of the README's ``-n N --dist loadgroup`` and gpu_ci's
many workers, and the order they are handed out in.

Plain: each test file is one group (a file's cases share its module fixtures
and, per world size, its worker's pools), handed out longest first: the
measured order (:mod:`dcpcheck.plugin.file_durations`), else the caller's
cold-start order; whichever worker is free takes the next file, so neither
idles at the end. Spread (``DCPCHECK_XDIST_SPREAD=1``, set by
``tools/gpu_ci.py``): every file is split by W, each part a group of its own,
handed out in the order of the command line (gpu_ci lists the longest
first), so that one file's world sizes run side by side (each part still
builds its scenarios once, on one worker); of the groups about to be handed
out, a worker takes one of the W it ran last, whose pool it holds. A realistic GPU file is split at
W <= 2 (where each rank's share of a case is largest) by DeepSeek model too;
its memory-heavy W = 4 and W = 8 parts stay one each. On one H200 a whole
file as one group set the wall time (``--dcp-impl vllm``'s
``test_combine.py``, 172 s on one worker).

The groups are chosen here, by path, in the scheduler: xdist 3.8's own
``loadgroup`` marks its groups in the legacy ``_nodeid``, which pytest 9.2
no longer reads, so ``xdist_group`` marks are silently ignored
(https://github.com/pytest-dev/pytest-xdist/issues/1386)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence

from dcpcheck.plugin.file_durations import handed_out_order, session_durations

GPU_PREFIX = "tests/gpu/"
SPREAD_ENV = "DCPCHECK_XDIST_SPREAD"


def file_of(nodeid: str) -> str:
    return nodeid.split("::")[0]


def spread_group(nodeid: str) -> str:
    path = file_of(nodeid)
    world = re.search(r"\[W(\d+)", nodeid)
    if not world:
        return path
    if not path.startswith(GPU_PREFIX) or int(world.group(1)) >= 4:
        return f"{path} W{world.group(1)}"
    model = re.search(r"-(v4\.\d)[-\]]", nodeid)
    return f"{path} W{world.group(1)} {model.group(1) if model else ''}".rstrip()


def world_of(group: str) -> int:
    world = re.search(r" W(\d+)", group)
    return int(world.group(1)) if world else 0


def widest_of_the_first_file(queue) -> Callable[[str], tuple[int, int]]:
    """Spread groups: the files in queue (command-line) order, and of a file's
    parts the largest W first (its longest: W ranks on the same cores). A
    realistic GPU file's parts keep their order (W ascending): handed out
    widest first, its W = 8, 4 and 2 prefill parts started together and ran
    an H100 out of memory."""
    position: dict[str, int] = {}
    for group in queue:
        position.setdefault(group.split(" ")[0], len(position))

    def key(group: str) -> tuple[int, int]:
        path = group.split(" ")[0]
        return position[path], 0 if path.startswith(GPU_PREFIX) else -world_of(group)

    return key


def next_group(queue, key: Callable[[str], object], last_world: int | None, workers: int) -> str:
    """The group a worker takes next: the first in ``key`` order, unless one of the next ``workers`` groups
    (those about to be handed out anyway) has the W of the worker's last group and no realistic GPU file's
    (whose parts keep their order): then that one. A worker keeps a pool per W it ran, a CUDA context a rank;
    spread groups handed out by order alone gave every worker every W, and on one H100 the pools' contexts
    left the large cases short of memory, so workers ended idle pools and started them again (gpu_ci at
    8a3ae70: 29 pool starts in the dsv41 session, 253 case-seconds)."""
    ordered = sorted(queue, key=key)
    for group in ordered[: max(workers, 1)]:
        if last_world and world_of(group) == last_world and not group.startswith(GPU_PREFIX):
            return group
    return ordered[0]


def path_groups_scheduler(config, log, cold_start_order: Sequence[str]):
    """xdist's scheduler for ``--dist loadgroup``: the groups above, handed out
    in the order above (``cold_start_order``: the longest files first, for a
    session without measured durations)."""
    from xdist.scheduler import LoadScopeScheduling

    spread = os.environ.get(SPREAD_ENV) == "1"
    order = handed_out_order(session_durations(config), cold_start_order)

    def handed_out_first(group: str) -> int:
        return order.index(group) if group in order else len(order)

    last_world: dict = {}  # per worker: the W of the group it took last

    class PathGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return spread_group(nodeid) if spread else file_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            # In place of xdist's order (by test count, unless --no-loadscope-reorder).
            if spread:
                key = widest_of_the_first_file(self.workqueue)
                first = next_group(self.workqueue, key, last_world.get(node), len(self.nodes))
                last_world[node] = world_of(first)
            else:
                first = min(self.workqueue, key=handed_out_first)  # min: the earliest of equals
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return PathGroups(config, log)
