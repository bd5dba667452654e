"""What ``shardwise bench``'s counted visit measures besides time: the bytes of every ``c10d``
collective any system dispatches (``CommCounter``), and peak memory under torch's MemTracker
with the gradient buckets it would otherwise miss."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.runtime import flat_tensors
from ..observer import accounting


class CommCounter(TorchDispatchMode):
    """Counts the bytes of every ``c10d`` collective dispatched while active, per kind.

    Bytes are what a ring moves per rank, as ``shardwise.comm_stats`` books them: (N-1)/N of the
    full tensor for all-gather and reduce-scatter (and of the tensor of a broadcast or reduce),
    twice that for all-reduce; N is the size of the collective's group (the default group's,
    ``world``, where the op does not say).
    """

    # op name -> (kind, which argument holds the full tensor(s))
    OPS: ClassVar[dict[str, tuple[str, int]]] = {
        "allreduce_": ("all_reduce", 0),
        "allreduce_coalesced_": ("all_reduce", 0),
        "_allgather_base_": ("all_gather", 0),
        "allgather_": ("all_gather", 0),
        "allgather_into_tensor_coalesced_": ("all_gather", 0),
        "_reduce_scatter_base_": ("reduce_scatter", 1),
        "reduce_scatter_": ("reduce_scatter", 1),
        "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
        "broadcast_": ("broadcast", 0),
        "reduce_": ("reduce", 0),
    }

    def __init__(self, world: int):
        super().__init__()
        self.world = world
        self.bytes: dict[str, int] = {}
        self.unknown: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func._schema.name.split("::")[-1]
            if name == "send":  # point to point: the message's own bytes
                self.bytes["send"] = self.bytes.get("send", 0) + sum(t.nbytes for t in args[0])
            elif name in self.OPS:
                kind, i = self.OPS[name]
                full = sum(t.nbytes for t in flat_tensors(args[i], []))
                factor = 2 if kind == "all_reduce" else 1
                n = _group_size(args, self.world)
                moved = factor * full * (n - 1) // n
                self.bytes[kind] = self.bytes.get(kind, 0) + moved
            elif name not in ("barrier", "monitored_barrier_", "recv_"):
                self.unknown.add(name)
        return func(*args, **(kwargs or {}))


def _group_size(args, default: int) -> int:
    """The size of the process group among a c10d op's arguments (boxed as a ScriptObject)."""
    for a in args:
        if isinstance(a, torch.ScriptObject):
            with contextlib.suppress(Exception):
                return dist.ProcessGroup.unbox(a).size()
    return default


def ddp_buckets(model: nn.Module) -> dict[int, torch.Tensor] | None:
    """DDP's gradient buckets, filled in as its backward hands them to a comm hook that keeps
    them and all-reduces as DDP's own does (None for the other systems)."""
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        return None
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    buckets: dict[int, torch.Tensor] = {}

    def keep_and_allreduce(group, bucket):
        buckets[bucket.index()] = bucket.buffer()
        return allreduce_hook(group, bucket)

    model.register_comm_hook(None, keep_and_allreduce)
    return buckets


def kept_buckets(model: nn.Module, ddp: dict[int, torch.Tensor] | None) -> list[torch.Tensor]:
    """The gradient buckets a system keeps from step to step besides its parameters, gradients
    and optimizer state: DDP's and shardwise no_shard's. MemTracker counts a tensor made before
    it starts only once an op writes it, so without them a peak before that write (say at the
    end of forward) would leave the buckets out."""
    if ddp is not None:
        return list(ddp.values())
    if not hasattr(model, "_shardwise"):  # the floor and FSDP2 keep none
        return []
    return accounting.kept_buckets(model)


def tracked_peak(model: nn.Module, opts: list, kept: list[torch.Tensor], step: Callable[[], object]) -> dict:
    """Peak bytes of one ``step`` under torch's MemTracker, and its breakdown at the peak."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, *opts, *kept)
    with tracker, warnings.catch_warnings():
        # its post-accumulate-grad hook finds .grad already moved on by shardwise's reduce;
        # the gradient itself was tracked by its tensor hook, which ran first
        warnings.filterwarnings("ignore", "Expected a tensor or a traceable wrapper-subclass")
        step()
    snap = tracker.get_tracker_snapshot("peak")
    dev = next((d for d in snap if d.type != "meta"), None)
    if dev is None:
        return {"Total": 0}
    return {str(k): int(v) for k, v in snap[dev].items()}
