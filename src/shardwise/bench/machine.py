"""The machine a benchmark runs on: what it is, and how busy other processes keep it (Linux
``/proc/stat``), so that a visit they disturbed can be told and run again."""

from __future__ import annotations

import contextlib
import os
import platform
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..core.groups import device

QUIET_PATIENCE_S = 60.0  # longest wait for a quiet machine before a visit


def describe(device_type: str) -> str:
    """The machine in a line: the GPU or CPU, its cores, torch and the backend."""
    if device_type == "cuda":
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}, NCCL"
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, Gloo"


def others_load(visit: dict) -> float:
    """The median share of the machine's CPU that other processes took during the visit's
    timed steps: busy time (rank 0's machine) less what this machine's ranks used (collective;
    the same answer on every rank)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    own, times, busy = (
        torch.tensor(visit[k], dtype=torch.float64, device=device())
        for k in ("own_cpu", "times", "busy")
    )
    own *= dist.get_rank() < local
    dist.all_reduce(own)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.broadcast(busy, 0)
    return float(((busy - own) / (times * (os.cpu_count() or 1))).clamp(0, 1).median())


def wait_until_quiet(quiet: float) -> bool:
    """Hold every rank until other processes leave the machine nearly idle (at most
    ``quiet`` of its CPU over half a second), for at most ``QUIET_PATIENCE_S``; whether it
    was (collective: the same answer on every rank)."""
    found = torch.ones(1, device=device())
    if quiet < 1 and dist.get_rank() == 0:
        deadline = time.monotonic() + QUIET_PATIENCE_S
        found.zero_()
        while not found and time.monotonic() < deadline:
            b0 = busy_s()
            time.sleep(0.5)
            found.fill_(float((busy_s() - b0) / (0.5 * (os.cpu_count() or 1)) <= quiet))
    dist.broadcast(found, 0)
    return bool(found)


def busy_s() -> float:
    """CPU seconds the whole machine spent busy since boot (Linux; 0 elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
