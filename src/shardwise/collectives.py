"""Counted collectives: the only place shardwise talks to torch.distributed.

Every call records per-rank bytes and seconds by kind; ``comm_stats()`` reads them, and every
figure the tools and benchmarks print comes from here. Bytes are what a ring algorithm moves per
rank: (N-1)/N of the full tensor for all-gather and reduce-scatter, twice that for all-reduce.

Note [Gloo gather and reduce-scatter]: Gloo's tensor all-gather stages through a fresh
full-size buffer and a copy, and its tensor reduce-scatter clones the input and all-reduces
the clone (twice the bytes). On Gloo, shardwise issues instead one in-place broadcast per
rank's slice of the output (all-gather) and one in-place reduce per rank's slice of the input
(reduce-scatter), all asynchronous: the same bytes per rank, no staging, less CPU
(docs/benchmarks.md measures it). The reduce-scatter's input is scratch there. NCCL keeps its
own collectives.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from . import events
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
    """An issued collective (one or more works); ``wait()`` blocks until it is done, runs
    its completion step, if any, and books its time."""

    __slots__ = ("works", "finish", "kind", "label", "group", "t_issue", "nbytes", "_done")

    def __init__(self, works: list, finish, kind: str, label: str, group, t_issue: float, nbytes: int):
        self.works, self.finish, self.kind, self.label, self.group = works, finish, kind, label, group
        self.t_issue, self.nbytes = t_issue, nbytes
        self._done = not works

    def completed(self) -> bool:
        """Whether every work has completed (without waiting; the completion step runs at the wait)."""
        return self._done or all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        if self._done:
            return
        t0 = time.perf_counter()
        try:
            for work in self.works:
                work.wait()
        except Exception as exc:  # Gloo raises on peer death and on timeout
            raise _collective_error(self.kind, self.label, self.group, exc) from exc
        if self.finish is not None:
            self.finish()
        t1 = time.perf_counter()
        s = _stats[self.kind]
        s.seconds += t1 - self.t_issue
        s.wait_seconds += t1 - t0
        self._done = True
        self.works = self.finish = None
        if events.listeners:
            events.emit("collective", self.label, kind=self.kind, bytes=self.nbytes, t_issue=self.t_issue, wait_s=t1 - t0)


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


class _SequenceCheck:
    """Debug mode: before each collective, ranks compare what they are about to issue.

    Each rank all-gathers a fingerprint (call number, kind, unit, elements, dtype) over a side
    Gloo group, so a rank that took another path is caught before the collective can
    mismatch, on every rank at once, with the unit each rank was at. Costs one small blocking
    round trip per collective, hence off by default (``shardwise.init(check_collectives=True)``).
    """

    def __init__(self):
        self.side = dist.new_group(backend="gloo")
        self.calls = 0
        self.labels: dict[int, str] = {}

    def check(self, kind: str, label: str, tensor: torch.Tensor) -> None:
        key = zlib.crc32(label.encode())
        self.labels[key] = label
        mine = torch.tensor(
            [self.calls, KINDS.index(kind), key, tensor.numel(), _DTYPES.index(tensor.dtype)],
            dtype=torch.int64,
        )
        self.calls += 1
        world = dist.get_world_size(self.side)
        everyone = torch.empty(world * 5, dtype=torch.int64)
        try:
            _all_gather_tensor(everyone, mine, group=self.side)
        except Exception as exc:
            raise _collective_error(kind, label, None, exc) from exc
        everyone = everyone.view(world, 5)
        if bool((everyone == mine).all()):
            return
        rows = [
            f"rank {r}: call #{int(f[0])} {KINDS[int(f[1])]} for unit "
            f"'{self.labels.get(int(f[2]), '?')}' ({int(f[3])} elements, {_DTYPES[int(f[4])]})"
            for r, f in enumerate(everyone)
        ]
        raise CollectiveError(
            "ranks diverged: they are about to issue different collectives; every rank must "
            "run the same units in the same order (look for data-dependent control flow). "
            + "; ".join(rows)
        )


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool]
_check: _SequenceCheck | None = None


def check_collectives(enabled: bool) -> None:
    """Turn the cross-rank collective sequence check on or off (collective: call on every rank)."""
    global _check
    _check = _SequenceCheck() if enabled else None


def _issue(kind: str, label: str, group, full: torch.Tensor, fn, *args, **kwargs) -> Pending:
    """Issue ``fn`` asynchronously; it returns a work, or (works, completion step)."""
    if _check is not None and group is None:
        _check.check(kind, label, full)
    t0 = time.perf_counter()
    try:
        issued = fn(*args, group=group, async_op=True, **kwargs)
    except Exception as exc:
        raise _collective_error(kind, label, group, exc) from exc
    works, finish = issued if isinstance(issued, tuple) else ([issued], None)
    return Pending(works, finish, kind, label, group, t0, full.numel() * full.element_size())


def _on_gloo(group) -> bool:
    return dist.get_world_size(group) > 1 and dist.get_backend(group) == dist.Backend.GLOO


def _global_rank(group, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def _gather_by_broadcasts(out: torch.Tensor, shard: torch.Tensor, *, group, async_op: bool):
    """All-gather as one in-place broadcast per rank's slice (Note [Gloo gather and reduce-scatter])."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    slices = out.view(world, -1)
    slices[rank].copy_(shard.view(-1))
    works = [
        dist.broadcast(slices[r], _global_rank(group, r), group=group, async_op=async_op)
        for r in range(world)
    ]
    return works, None


def _reduce_scatter_by_reduces(out: torch.Tensor, full: torch.Tensor, *, group, async_op: bool):
    """Reduce-scatter as one in-place reduce per rank's slice (Note [Gloo gather and
    reduce-scatter]); this rank's slice is copied to ``out`` at the wait."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    slices = full.view(world, -1)
    works = [
        dist.reduce(slices[r], _global_rank(group, r), op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        for r in range(world)
    ]
    return works, lambda: out.view(-1).copy_(slices[rank])


def all_gather(out: torch.Tensor, shard: torch.Tensor, group, label: str) -> Pending:
    """Gather every rank's equal-sized ``shard`` into ``out`` (rank-major), asynchronously."""
    world = dist.get_world_size(group)
    _book("all_gather", out.numel() * out.element_size(), world)
    fn = _gather_by_broadcasts if _on_gloo(group) else _all_gather_tensor
    return _issue("all_gather", label, group, out, fn, out, shard)


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, group, label: str) -> Pending:
    """Sum ``full`` over ranks and leave this rank's equal slice in ``out``, asynchronously.
    ``full`` is scratch: on Gloo it holds partial sums afterwards."""
    world = dist.get_world_size(group)
    _book("reduce_scatter", full.numel() * full.element_size(), world)
    fn = _reduce_scatter_by_reduces if _on_gloo(group) else _reduce_scatter_tensor
    return _issue("reduce_scatter", label, group, full, fn, out, full)


def all_reduce(
    tensor: torch.Tensor, group, label: str, op: dist.ReduceOp = dist.ReduceOp.SUM
) -> Pending:
    """Reduce ``tensor`` in place over ranks, asynchronously."""
    world = dist.get_world_size(group)
    _book("all_reduce", tensor.numel() * tensor.element_size(), world, factor=2)
    return _issue("all_reduce", label, group, tensor, dist.all_reduce, tensor, op=op)


def broadcast(tensor: torch.Tensor, src_rank: int, group, label: str) -> Pending:
    """Copy ``tensor`` from group rank ``src_rank`` to every rank, asynchronously."""
    world = dist.get_world_size(group)
    _book("broadcast", tensor.numel() * tensor.element_size(), world)
    return _issue("broadcast", label, group, tensor, dist.broadcast, tensor, _global_rank(group, src_rank))
