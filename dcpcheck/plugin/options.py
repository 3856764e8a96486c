"""The suite's command-line options, their defaults, and reading them."""

from __future__ import annotations

import math

import pytest

DEFAULT_SELECTED = {"cpu": "1,2,4", "cuda": "1,2,4,8"}
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_STARTUP_TIMEOUT_S = 240.0


def pytest_addoption(parser):
    group = parser.getgroup("dcpcheck", "DCP staged correctness suite")
    group.addoption(
        "--dcp-impl",
        default="port",
        help="implementation under test: port (default), vllm, pkg.module:attr or path/file.py:attr",
    )
    group.addoption(
        "--world-sizes",
        default=None,
        help="comma-separated DCP world sizes to run (default 1,2,4 on CPU; 1,2,4,8 on CUDA, whatever the GPU count)",
    )
    group.addoption(
        "--dcp-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds one multi-rank case may take before its ranks are declared stuck (default {DEFAULT_TIMEOUT_S:g})",
    )
    group.addoption(
        "--dcp-startup-timeout",
        type=float,
        default=DEFAULT_STARTUP_TIMEOUT_S,
        help=f"seconds a pool of ranks (torchrun: init_process_group) may take to start "
        f"(default {DEFAULT_STARTUP_TIMEOUT_S:g})",
    )
    group.addoption(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where ranks run: auto = cuda when a GPU is visible, else cpu",
    )
    group.addoption(
        "--gpu-sharing",
        choices=("on", "off"),
        default="on",
        help="on CUDA, with fewer GPUs than ranks: on (default) = rank r on cuda:(r %% GPUs), gloo between them; "
        "off = skip such world sizes (torchrun: refuse)",
    )
    group.addoption("--dcp-seed", type=int, default=0, help="base seed; each test adds a stable hash of its id")


def parse_world_sizes(raw: str) -> tuple:
    try:
        sizes = tuple(sorted({int(part) for part in raw.split(",") if part.strip()}))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise pytest.UsageError(f"--world-sizes {raw!r}: expected comma-separated positive integers, e.g. 1,2,4,8")
    return sizes


def selected_world_sizes(config, device_type: str) -> tuple:
    return parse_world_sizes(config.getoption("world_sizes") or DEFAULT_SELECTED[device_type])


def resolve_device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda: no CUDA device is visible (use --device cpu or auto)")
    return choice


def visible_gpus(device_type: str) -> int:
    if device_type != "cuda":
        return 0
    import torch

    return torch.cuda.device_count()


# The longest timeout accepted (about 11.6 days): far below what the platform
# can wait (threading.TIMEOUT_MAX, a timedelta's days, gloo's milliseconds),
# with room for the grace periods added to it.
MAX_TIMEOUT_S = 1e6


def _seconds(config, name: str) -> float:
    """A timeout option's value: a finite number of seconds above 0 and at most
    MAX_TIMEOUT_S (nan, inf, 0 and negatives would make every case fail or none
    ever end; past the maximum, waits overflow)."""
    value = config.getoption(name)
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        flag = "--" + name.replace("_", "-")
        raise pytest.UsageError(
            f"{flag} {value:g}: expected a finite number of seconds above 0 and at most {MAX_TIMEOUT_S:g}, e.g. 60"
        )
    return value


def case_timeout(config) -> float:
    return _seconds(config, "dcp_timeout")


def startup_timeout(config) -> float:
    return _seconds(config, "dcp_startup_timeout")
