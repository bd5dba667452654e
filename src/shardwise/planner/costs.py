"""The budget planner's cost model: the seconds a per-unit setting adds to a step.

Recomputing a unit (activation checkpointing) costs its forward FLOPs over the device's matmul
rate; offloading a unit's state costs its bytes over the host link; resharding a unit after
forward costs its second all-gather's bytes over the network. The matmul rate (in the run's
compute dtype) and the host copy bandwidth are measured once on this machine and cached
(``SHARDWISE_CACHE``, else ``$XDG_CACHE_HOME/shardwise``, else ``~/.cache/shardwise``); the
network's is a constant per backend (a fake world sends nothing to time). A plan for NCCL made
where there is no GPU prices it at a reference GPU's rates (``REFERENCE_GPU``), not at this
CPU's, and says so: the CPU's would make recomputation look ~1000x dearer than it is.
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


# an H100 SXM's dense matmul FLOP/s per compute dtype (about 70% of its data sheet's peaks) and
# its host link (PCIe 5 x16, pinned copies): what a plan for NCCL is priced at without a GPU
REFERENCE_GPU = "an H100's reference rates (no GPU here)"
REFERENCE_FLOPS = {torch.float32: 4.7e13, torch.bfloat16: 6.9e14, torch.float16: 6.9e14}
REFERENCE_HOST = 2.5e10


@dataclass(frozen=True)
class Rates:
    """What one FLOP and one byte cost here."""

    flops: float  # matmul FLOP/s of the compute device, in the run's compute dtype
    host: float  # bytes/s of host <-> device copies (on a CPU run: a copy within memory)
    network: float  # bytes/s per rank over the collectives' link (``NETWORK``)
    where: str = "the given rates"  # what the figures are: measured on which device, or a reference

    def seconds(self, *, flops: float = 0, host: float = 0, network: float = 0) -> float:
        return flops / self.flops + host / self.host + network / self.network


def cache_dir() -> Path:
    if os.environ.get("SHARDWISE_CACHE"):
        return Path(os.environ["SHARDWISE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shardwise"


def rates(backend: str, dtype: torch.dtype = torch.float32) -> Rates:
    """The rates for a run on ``backend`` ("nccl": this machine's GPU, or ``REFERENCE_GPU``'s
    where there is none; "gloo": its CPU) computing in ``dtype``, measured the first time and
    read from the cache after."""
    if backend == "nccl" and not torch.cuda.is_available():
        return Rates(REFERENCE_FLOPS.get(dtype, REFERENCE_FLOPS[torch.float32]), REFERENCE_HOST, NETWORK[backend], REFERENCE_GPU)
    device = "cuda" if backend == "nccl" else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else f"cpu x{torch.get_num_threads()}"
    name += f", {str(dtype).removeprefix('torch.')}"
    path = cache_dir() / "rates.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if name not in known:
        known[name] = _measure(torch.device(device), dtype)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(known, indent=1))
        except OSError:  # a read-only home: measure again next time
            pass
    return Rates(network=NETWORK[backend], where=f"rates measured on {name}", **known[name])


def _measure(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """The matmul FLOP rate (1024^2 matrices in ``dtype``) and the host copy bandwidth (64 MiB,
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
    a = torch.randn(n, n, device=device, dtype=dtype)
    matmul = best(lambda: a @ a)
    host = torch.empty(16 * 2**20, pin_memory=device.type == "cuda")
    target = torch.empty_like(host, device=device)
    copy = best(lambda: target.copy_(host, non_blocking=True))
    return {"flops": 2 * n**3 / matmul, "host": host.nbytes / copy}
