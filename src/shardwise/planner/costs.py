"""The budget planner's cost model: the seconds a per-unit setting adds to a step.

Recomputing a unit (activation checkpointing) costs its forward FLOPs over the device's matmul
rate; offloading a unit's state costs its bytes over the host link; resharding a unit after
forward costs its second all-gather's bytes over the network. The matmul rate and the host
copy bandwidth are measured once on this machine and cached (``SHARDWISE_CACHE``, else
``$XDG_CACHE_HOME/shardwise``, else ``~/.cache/shardwise``); the network's is a constant per
backend (a fake world sends nothing to time).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# bytes per second per rank on the link: NVLink-class for NCCL within a node, loopback TCP
# for Gloo on one machine (a plan for a slower fabric overstates what resharding costs)
NETWORK = {"nccl": 50e9, "gloo": 1e9}


@dataclass(frozen=True)
class Rates:
    """What one FLOP and one byte cost here."""

    flops: float  # matmul FLOP/s of the compute device
    host: float  # bytes/s of host <-> device copies (on a CPU run: a copy within memory)
    network: float  # bytes/s per rank over the collectives' link (``NETWORK``)

    def seconds(self, *, flops: float = 0, host: float = 0, network: float = 0) -> float:
        return flops / self.flops + host / self.host + network / self.network


def cache_dir() -> Path:
    if os.environ.get("SHARDWISE_CACHE"):
        return Path(os.environ["SHARDWISE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shardwise"


def rates(backend: str) -> Rates:
    """The rates for a run on ``backend`` ("nccl": this machine's GPU; "gloo": its CPU),
    measured the first time and read from the cache after."""
    device = "cuda" if backend == "nccl" and torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else f"cpu x{torch.get_num_threads()}"
    path = cache_dir() / "rates.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if name not in known:
        known[name] = _measure(torch.device(device))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(known, indent=1))
        except OSError:  # a read-only home: measure again next time
            pass
    return Rates(network=NETWORK[backend], **known[name])


def _measure(device: torch.device) -> dict[str, float]:
    """The matmul FLOP rate (1024^2 fp32 matrices) and the host copy bandwidth (64 MiB,
    pinned host memory to the device on CUDA), best of a few repetitions."""

    def best(fn, repeat: int = 5) -> float:
        fn()
        times = []
        for _ in range(repeat):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return min(times)

    n = 1024
    a = torch.randn(n, n, device=device)
    matmul = best(lambda: a @ a)
    host = torch.empty(16 * 2**20, pin_memory=device.type == "cuda")
    target = torch.empty_like(host, device=device)
    copy = best(lambda: target.copy_(host, non_blocking=True))
    return {"flops": 2 * n**3 / matmul, "host": host.nbytes / copy}
