"""Counted collectives: the only place shardwise talks to torch.distributed.

Every call records per-rank bytes and seconds by kind; ``comm_stats()`` reads them, and every
figure the tools and benchmarks print comes from here. Bytes are what a ring algorithm moves per
rank: (N-1)/N of the full tensor for all-gather and reduce-scatter, twice that for all-reduce.

Note [Gloo gather and reduce-scatter]: Gloo's tensor all-gather stages through a fresh
full-size buffer and a copy, and its tensor reduce-scatter clones the input and all-reduces
the clone (twice the bytes). On Gloo, shardwise issues instead one broadcast per rank, each
rank sending its shard from where it lies into the others' receive rows (all-gather), and one
in-place reduce per destination rank, this rank's own row being its output (reduce-scatter),
all asynchronous: the same bytes per rank, no staging, no copy of this rank's own slice, less
CPU (docs/benchmarks.md measures it). So the collectives hand out rows, one per rank
(``all_gather``'s result, ``scatter_rows``), not one rank-major tensor. NCCL keeps its own
collectives (its rows are those of one rank-major buffer).

Note [fake world]: the planner runs the real runtime as rank 0 of N ranks in one process, on
fake tensors over torch's "fake" process group, which sends nothing (``groups.fake_world``).
There, ``standing_in(backend)`` makes that group take the paths of the backend the plan is
for (Gloo's rows or NCCL's buffer) and count into counters of its own, so that the caller's
``comm_stats`` stay as they were.
"""

from __future__ import annotations

import contextlib
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
    its completion step, if any, and books its time. It holds the buffers it was handed until
    then, as the backend's works do (torch's fake group, which the planner runs on, holds none)."""

    __slots__ = ("works", "finish", "kind", "label", "group", "t_issue", "nbytes", "result", "buffers", "_done")

    def __init__(
        self, works: list, finish, kind: str, label: str, group, t_issue: float, nbytes: int, result=None,
        buffers=None,
    ):
        self.works, self.finish, self.kind, self.label, self.group = works, finish, kind, label, group
        self.t_issue, self.nbytes, self.result, self.buffers = t_issue, nbytes, result, buffers
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
            work = None  # (it holds its buffers: they go with the works, before the event)
        except Exception as exc:  # Gloo raises on peer death and on timeout
            raise _collective_error(self.kind, self.label, self.group, exc) from exc
        if self.finish is not None:
            self.finish()
        t1 = time.perf_counter()
        s = _stats[self.kind]
        s.seconds += t1 - self.t_issue
        s.wait_seconds += t1 - t0
        self._done = True
        self.works = self.finish = self.buffers = None
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


def _issue(kind: str, label: str, group, nbytes: int, check: torch.Tensor, fn, *args, **kwargs) -> Pending:
    """Issue ``fn`` asynchronously; it returns a work, or (works, completion step, result)."""
    if _check is not None and group is None:
        _check.check(kind, label, check)
    t0 = time.perf_counter()
    try:
        issued = fn(*args, group=group, async_op=True, **kwargs)
    except Exception as exc:
        raise _collective_error(kind, label, group, exc) from exc
    works, finish, result = issued if isinstance(issued, tuple) else ([issued], None, None)
    return Pending(works, finish, kind, label, group, t0, nbytes, result, buffers=args)


_stands_for: str | None = None  # the backend torch's "fake" group stands for (Note [fake world])


@contextlib.contextmanager
def standing_in(backend: str):
    """Inside, torch's "fake" group takes ``backend``'s collective paths, and collectives
    count apart from the caller's ``comm_stats`` with the debug check off (Note [fake world])."""
    global _stats, _check, _stands_for
    saved = _stats, _check, _stands_for
    _stats, _check, _stands_for = {k: CollectiveStats() for k in KINDS}, None, backend
    try:
        yield
    finally:
        _stats, _check, _stands_for = saved


def _on_gloo(group) -> bool:
    if dist.get_world_size(group) == 1:
        return False
    backend = dist.get_backend(group)
    if backend == "fake" and _stands_for is not None:
        backend = _stands_for
    return backend == dist.Backend.GLOO


def _global_rank(group, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def _gather_rows(shard: torch.Tensor, *, group, async_op: bool):
    """Every rank's shard, as a list indexed by rank: this rank's is ``shard`` itself.

    Gloo: one in-place broadcast per rank into N-1 receive rows (Note [Gloo gather and
    reduce-scatter]). Otherwise one all-gather into a rank-major buffer.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = shard.view(-1)
    if world == 1:
        return [], None, [mine]
    if _on_gloo(group):
        rows = list(mine.new_empty(world - 1, mine.numel()).unbind(0))
        rows.insert(rank, mine)
        works = [
            dist.broadcast(rows[r], _global_rank(group, r), group=group, async_op=async_op)
            for r in range(world)
        ]
        return works, None, rows
    out = mine.new_empty(world, mine.numel())
    return [_all_gather_tensor(out, mine, group=group, async_op=async_op)], None, list(out.unbind(0))


def all_gather(shard: torch.Tensor, group, label: str) -> Pending:
    """Gather every rank's equal-sized ``shard``, asynchronously; after ``wait()``,
    ``result[r]`` is rank r's shard (``result[rank]`` is ``shard``: read it, don't write it)."""
    world = dist.get_world_size(group)
    nbytes = world * shard.numel() * shard.element_size()
    _book("all_gather", nbytes, world)
    return _issue("all_gather", label, group, nbytes, shard, _gather_rows, shard)


@dataclass
class ScatterRows:
    """The buffers of one reduce-scatter of ``numel`` elements per rank (``scatter_rows``).

    Fill ``rows[r]`` with this rank's contribution to rank r's sum, then ``reduce_scatter``;
    ``out`` holds this rank's sum after the wait. On Gloo ``out`` is this rank's own row,
    reduced in place, and the other rows are scratch.
    """

    rows: list[torch.Tensor]
    out: torch.Tensor
    full: torch.Tensor | None  # the rows as one rank-major tensor, where the backend needs it


def scatter_rows(numel: int, dtype: torch.dtype, device: torch.device, group) -> ScatterRows:
    """Fresh buffers for a reduce-scatter over ``group`` (see ``ScatterRows``)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    out = torch.empty(numel, dtype=dtype, device=device)
    if world == 1:
        return ScatterRows([out], out, None)
    if _on_gloo(group):
        rows = list(torch.empty(world - 1, numel, dtype=dtype, device=device).unbind(0))
        rows.insert(rank, out)
        return ScatterRows(rows, out, None)
    full = torch.empty(world, numel, dtype=dtype, device=device)
    return ScatterRows(list(full.unbind(0)), out, full)


def _reduce_rows(buf: ScatterRows, *, group, async_op: bool):
    if buf.full is None:  # Gloo: one in-place reduce per destination rank
        works = [
            dist.reduce(row, _global_rank(group, r), op=dist.ReduceOp.SUM, group=group, async_op=async_op)
            for r, row in enumerate(buf.rows)
        ]
        return works, None, None
    return [_reduce_scatter_tensor(buf.out, buf.full, group=group, async_op=async_op)], None, None


def reduce_scatter(buf: ScatterRows, group, label: str) -> Pending:
    """Sum the filled ``buf.rows`` over ranks into ``buf.out``, asynchronously (the other
    rows are scratch afterwards)."""
    world = dist.get_world_size(group)
    nbytes = world * buf.out.numel() * buf.out.element_size()
    _book("reduce_scatter", nbytes, world)
    if world == 1:
        return Pending([], None, "reduce_scatter", label, group, time.perf_counter(), nbytes)
    return _issue("reduce_scatter", label, group, nbytes, buf.out, _reduce_rows, buf)


def all_reduce(
    tensor: torch.Tensor, group, label: str, op: dist.ReduceOp = dist.ReduceOp.SUM
) -> Pending:
    """Reduce ``tensor`` in place over ranks, asynchronously."""
    world = dist.get_world_size(group)
    _book("all_reduce", tensor.numel() * tensor.element_size(), world, factor=2)
    nbytes = tensor.numel() * tensor.element_size()
    return _issue("all_reduce", label, group, nbytes, tensor, dist.all_reduce, tensor, op=op)


def broadcast(tensor: torch.Tensor, src_rank: int, group, label: str) -> Pending:
    """Copy ``tensor`` from group rank ``src_rank`` to every rank, asynchronously."""
    world = dist.get_world_size(group)
    _book("broadcast", tensor.numel() * tensor.element_size(), world)
    nbytes = tensor.numel() * tensor.element_size()
    return _issue("broadcast", label, group, nbytes, tensor, dist.broadcast, tensor, _global_rank(group, src_rank))
