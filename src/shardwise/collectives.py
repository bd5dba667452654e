"""Counted collectives: the only place shardwise talks to torch.distributed.

Every call records per-rank bytes and seconds by kind; ``comm_stats()`` reads them, and every
figure the tools and benchmarks print comes from here. Bytes are what a ring algorithm moves per
rank: (N-1)/N of the full tensor for all-gather and reduce-scatter, twice that for all-reduce.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from .errors import CollectiveError

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


@dataclass
class CollectiveStats:
    """Totals for one kind of collective on this rank since the last reset."""

    calls: int = 0
    bytes: int = 0  # bytes moved per rank by a ring algorithm, (N-1)/N of the full tensor
    payload_bytes: int = 0  # bytes of the full (gathered / reduced) tensor
    seconds: float = 0.0  # issue to completion as seen by this rank
    wait_seconds: float = 0.0  # of those, time this rank was blocked waiting (not overlapped)


_stats: dict[str, CollectiveStats] = {k: CollectiveStats() for k in KINDS}


def comm_stats(*, reset: bool = False) -> dict[str, CollectiveStats]:
    """Per-rank totals of each collective kind since the last reset (copies; ``reset`` zeroes)."""
    out = {k: replace(v) for k, v in _stats.items()}
    if reset:
        reset_comm_stats()
    return out


def reset_comm_stats() -> None:
    """Zero the counters that ``comm_stats()`` reads."""
    for k in KINDS:
        _stats[k] = CollectiveStats()


class Pending:
    """An issued collective; ``wait()`` blocks until it is done and books its time."""

    __slots__ = ("work", "kind", "label", "group", "t_issue", "_done")

    def __init__(self, work, kind: str, label: str, group, t_issue: float):
        self.work, self.kind, self.label, self.group = work, kind, label, group
        self.t_issue = t_issue
        self._done = work is None

    def wait(self) -> None:
        if self._done:
            return
        t0 = time.perf_counter()
        try:
            self.work.wait()
        except Exception as exc:  # Gloo raises on peer death and on timeout
            raise _collective_error(self.kind, self.label, self.group, exc) from exc
        t1 = time.perf_counter()
        s = _stats[self.kind]
        s.seconds += t1 - self.t_issue
        s.wait_seconds += t1 - t0
        self._done = True


def _collective_error(kind: str, label: str, group, exc: BaseException) -> CollectiveError:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return CollectiveError(
        f"rank {rank}: {kind} for unit '{label}' did not complete ({type(exc).__name__}: "
        f"{str(exc).splitlines()[0] if str(exc) else exc!r}). Another rank died, raised, or "
        "issued a different collective: every rank must run the same units in the same order. "
        "The time limit is set with shardwise.init(timeout=seconds)."
    )


def _book(kind: str, nbytes_full: int, world: int, factor: int = 1) -> None:
    s = _stats[kind]
    s.calls += 1
    s.payload_bytes += nbytes_full
    s.bytes += factor * nbytes_full * (world - 1) // world


def _issue(kind: str, label: str, group, fn, *args, **kwargs) -> Pending:
    t0 = time.perf_counter()
    try:
        work = fn(*args, group=group, async_op=True, **kwargs)
    except Exception as exc:
        raise _collective_error(kind, label, group, exc) from exc
    return Pending(work, kind, label, group, t0)


def all_gather(out: torch.Tensor, shard: torch.Tensor, group, label: str) -> Pending:
    """Gather every rank's equal-sized ``shard`` into ``out`` (rank-major), asynchronously."""
    world = dist.get_world_size(group)
    _book("all_gather", out.numel() * out.element_size(), world)
    return _issue("all_gather", label, group, _all_gather_tensor, out, shard)


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, group, label: str) -> Pending:
    """Sum ``full`` over ranks and leave this rank's equal slice in ``out``, asynchronously."""
    world = dist.get_world_size(group)
    _book("reduce_scatter", full.numel() * full.element_size(), world)
    return _issue("reduce_scatter", label, group, _reduce_scatter_tensor, out, full)


def all_reduce(
    tensor: torch.Tensor, group, label: str, op: dist.ReduceOp = dist.ReduceOp.SUM
) -> Pending:
    """Reduce ``tensor`` in place over ranks, asynchronously."""
    world = dist.get_world_size(group)
    _book("all_reduce", tensor.numel() * tensor.element_size(), world, factor=2)
    return _issue("all_reduce", label, group, dist.all_reduce, tensor, op=op)


def broadcast(tensor: torch.Tensor, src_rank: int, group, label: str) -> Pending:
    """Copy ``tensor`` from group rank ``src_rank`` to every rank, asynchronously."""
    world = dist.get_world_size(group)
    _book("broadcast", tensor.numel() * tensor.element_size(), world)
    src = dist.get_global_rank(group, src_rank) if group is not None else src_rank
    return _issue("broadcast", label, group, dist.broadcast, tensor, src)
