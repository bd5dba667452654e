"""What a plan predicts for one configuration (``Estimate``), read off the trace of a step
the real runtime took on fake tensors (planner/plan.py runs it)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..api import units
from ..core.policies import Recompute, Settings, Sharding
from ..core.unit import ShardedUnit
from ..core.wrap import Policy
from ..observer.trace import when


@dataclass(frozen=True)
class UnitRow:
    """One unit as every rank holds it (bytes per rank; the padded flat buffers)."""

    name: str
    params: int  # parameter elements, without padding
    shard_bytes: int
    gathered_bytes: int  # its full parameters in the compute dtype while gathered
    owned: tuple[tuple[str, int, int], ...] = ()  # (parameter, owner rank, bytes): owned placement


@dataclass(frozen=True)
class Estimate:
    """The prediction for one configuration: bytes per rank (the largest rank's), per step."""

    strategy: Sharding
    wrap: str
    world_size: int
    mixed_precision: str
    cpu_offload: bool
    activation_checkpointing: bool
    units: tuple[UnitRow, ...]
    param_shards: int  # whole parameters for no_shard
    gradients: int  # gradient shards (whole gradients for no_shard) after backward
    optimizer: int  # optimizer state
    gathered_peak: int  # most bytes of gathered parameters at one moment
    activations: int  # activations and temporaries of one micro-batch at their peak
    peak: int  # the device's predicted peak; on a CPU run, host and device (Note [one memory])
    peak_at: str  # when it happens
    # host memory with offload (shards, gradients, state, the step's temporaries; activations'
    # host copies); 0 where host and device are one memory (a CPU run: ``peak`` counts both,
    # Note [one memory])
    host: int
    comm: dict[str, int] = field(default_factory=dict)  # bytes sent per step, by collective
    # peaks by stage: "shard" (shard() itself, host and device) and "after_shard" (what it
    # leaves), then on the device "forward", "backward" (the loss included) and "optimizer"
    # (the host's, with cpu_offload on a GPU)
    phases: dict[str, int] = field(default_factory=dict)
    settings: Settings | None = None  # what shard(plan=...) applies for it

    @property
    def model_state(self) -> int:
        """Parameter shards, gradients and optimizer state: what a step leaves behind."""
        return self.param_shards + self.gradients + self.optimizer

    @property
    def sent(self) -> int:
        return sum(self.comm.values())

    @property
    def label(self) -> str:
        parts = [f"{self.strategy}" + ("" if self.strategy.shard else " (DDP)")]
        if self.wrap != "-":
            parts.append(f"wrap {self.wrap}")
        if self.activation_checkpointing:
            parts.append("checkpointing")
        if self.cpu_offload:
            parts.append("offload")
        return ", ".join(parts)


# Note [one memory]: under Gloo shardwise computes on the CPU, so the "device" is host memory:
# offload of a unit's state (shards, gradients, optimizer state) or of its activations moves
# bytes from one part of that memory to another and saves nothing (it adds the copies). The
# estimate's peak then counts all of it, host and device together, and a budget never tries
# offload there (ONE_MEMORY says why). Under NCCL they are two memories: the device peak leaves
# out what offload keeps on the host (the state's share, landed gradients, and the activations'
# host copies, Note [host copies] in activation_offload.py), and ``host`` counts it.
ONE_MEMORY = (
    "on CPU (gloo) host and device are one memory: offload of state or of activations moves "
    "bytes within it and saves nothing, so the peak counts both and a budget never chooses "
    "either"
)


def estimate_of(
    data: dict,
    shard_bytes: tuple[int, int],
    settings: Settings,
    host_activations: list[int],
    *,
    checkpointing: bool,
    precision_name: str,
    one_memory: bool,
) -> Estimate:
    """The estimate read off a traced step (rank 0's record; see the module doc). With
    offload on a GPU the host holds the offloaded units' shards, optimizer state and landed
    gradients; the device the rest, with the optimizer step's temporaries where any unit
    steps there (all of them: an upper bound, as which are made on the host depends on the
    optimizer's implementation). Offloaded activations are on the host from their copy out to
    their copy back (``host_activations``: the bytes there after each ``activations`` event).
    On a CPU run both are one memory, and the peak is all of it (Note [one memory])."""
    offloaded = [c.offload for _, c in settings.units]  # (in the runtime's order of units)
    split = any(offloaded) and not one_memory  # host and device apart
    rank, cats = data["ranks"][0], data["categories"]
    rows = [dict(zip(cats, m[2:-1]), peak=m[-1]) for m in rank["memory"] if m[1] == "cpu"]
    labels, stages = when(rank, data["units"])
    after_backward = stages.index("optimizer") - 1  # the sample as the optimizer begins
    step = [r for r, s in zip(rows, stages) if s == "optimizer"]
    held = [0] * len(rows) if one_memory else _held(rank, host_activations)
    state = [0.0] * len(rows)  # on the host: offloaded state and gradients landed there
    share = 0.0  # of the shards' bytes, offloaded
    if split:
        landed = _landed(rank, data["units"], offloaded)
        # the offloaded units' shards and optimizer state, to the byte (not a share of the
        # totals: the optimizer's step counters, one per parameter, are not in proportion to
        # the shards' bytes, and a share of them is not affine in the blocks alike)
        held_there = sum(u["shard_bytes"] + u["state_bytes"] for u, o in zip(data["units"], offloaded) if o)
        state = [held_there + g for g in landed]
        sizes = [u["shard_bytes"] for u in data["units"]]
        share = sum(b for b, o in zip(sizes, offloaded) if o) / max(1, sum(sizes))
    # the optimizer step's temporaries are the device's unless all the state steps on the host
    device = [
        r["peak"] - a - h - (r["peak"] - sum(r[c] for c in cats) if share == 1 and s == "optimizer" else 0)
        for r, s, a, h in zip(rows, stages, state, held)
    ]
    host = max(a + h for a, h in zip(state, held))
    top = max(range(len(rows)), key=device.__getitem__)
    phases = {"shard": shard_bytes[0], "after_shard": shard_bytes[1]}
    for stage in ("forward", "backward", "optimizer"):
        phases[stage] = max((d for d, s in zip(device, stages) if s == stage), default=0)
    return Estimate(
        strategy=settings.strategy,
        wrap=_policy_name(settings.wrap) if settings.strategy.shard else "-",
        world_size=data["world_size"],
        mixed_precision=precision_name,
        cpu_offload=any(offloaded),
        activation_checkpointing=checkpointing or any(c.checkpoint is not Recompute.NONE for _, c in settings.units),
        units=tuple(
            UnitRow(u["name"], u["params"], u["shard_bytes"], u["gathered_bytes"], tuple(map(tuple, u.get("owned", ()))))
            for u in data["units"]
        ),
        param_shards=rows[after_backward]["param_shards"],
        gradients=rows[after_backward]["gradients"],
        optimizer=rows[-1]["optimizer"],
        gathered_peak=max(r["gathered"] for r in rows),
        activations=max(r["activations"] - h for r, h in zip(rows, held)),
        peak=int(device[top]),
        peak_at=labels[top],
        host=int(max(host, *(r["peak"] for r in step)) if split else host),
        comm=_mean_comm(rank["comm"], data["world_size"], data["units"]),
        phases={k: int(v) for k, v in phases.items()},
        settings=settings,
    )


def _mean_comm(comm: dict, world: int, units: list[dict]) -> dict[str, int]:
    """Bytes sent per step by collective. With owned parameters a rank's gathers and
    reductions move the whole less its own share, which differs between ranks: their mean,
    (N-1)/N of the whole as for rows, stands for every rank."""
    owned = any(u.get("owned") for u in units)
    return {
        k: c["payload_bytes"] * (world - 1) // world if owned and k in ("all_gather", "reduce_scatter") else c["bytes"]
        for k, c in comm.items()
        if k != "broadcast"
    }


def _held(rank: dict, host: list[int]) -> list[int]:
    """For each CPU memory sample, the bytes of activations in host memory through the
    interval it closes: those after the last ``activations`` event before it (Note [host
    copies] in activation_offload.py)."""
    times = [e[0] for e in rank["events"] if e[1] == "activations"]
    assert len(times) == len(host), f"rank 0: {len(times)} activations events, {len(host)} heard"
    out, k, now = [], 0, 0
    for sample in rank["memory"]:
        if sample[1] == "cpu":
            while k < len(times) and times[k] < sample[0]:
                now, k = host[k], k + 1
            out.append(now)
    return out


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Each unit's optimizer state in bytes (the state of its shard parameters), by unit name."""
    out = {}
    for u in units(model):
        params = u.shard_params if isinstance(u, ShardedUnit) else u.params
        out[u.label] = sum(
            t.nbytes for p in params for t in optimizer.state.get(p, {}).values() if isinstance(t, torch.Tensor)
        )
    return out


def _landed(rank: dict, units: list[dict], offloaded: list[bool]) -> list[int]:
    """For each CPU memory sample, the bytes of gradient shards landed in host memory so far
    (an offloaded unit's when its reduction is done; as large as its shard)."""
    size = [u["shard_bytes"] if o else 0 for u, o in zip(units, offloaded)]
    done = sorted((e[0], size[e[2]]) for e in rank["events"] if e[1] == "reduce_done")
    out, k, total = [], 0, 0
    for sample in rank["memory"]:
        if sample[1] == "cpu":
            while k < len(done) and done[k][0] <= sample[0]:
                total += done[k][1]
                k += 1
            out.append(total)
    return out


def _policy_name(policy: Policy | None) -> str:
    return "none" if policy is None else repr(policy)
