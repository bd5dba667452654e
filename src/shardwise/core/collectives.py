"""Counted collectives: the only place shardwise talks to torch.distributed.

Every call records per-rank bytes and seconds by kind; ``comm_stats()`` reads them, and every
figure the tools and benchmarks print comes from here. Bytes are what a ring algorithm moves per
rank: (N-1)/N of the full tensor for all-gather and reduce-scatter, twice that for all-reduce.

Note [Gloo gather and reduce-scatter]: Gloo's tensor all-gather stages through a fresh
full-size buffer and a copy, and its tensor reduce-scatter clones the input and all-reduces
the clone (twice the bytes). On Gloo, shardwise exchanges point-to-point messages instead:
a gather sends this rank's shard from where it lies to every other rank and receives theirs
into N-1 rows; a reduce-scatter sends each destination its row and adds the N-1 rows it
receives into its own, which is its output. The same bytes per rank, no staging, no copy of
this rank's own slice (docs/benchmarks.md measures it). So the collectives hand out rows, one
per rank (``all_gather``'s result, ``scatter_rows``), not one rank-major tensor. NCCL keeps
its own collectives (its rows are those of one rank-major buffer).

Note [tagged Gloo messages]: those messages carry a tag of their unit and kind (``channel``),
so a message can only ever meet the same unit's message on another rank, whatever order the
ranks issue them in. Ranks that part ways (a unit run on some ranks only) then wait for each
other until the timeout and are named by the flight recorder (flight.py), instead of pairing
two units' collectives: with equal sizes that sums the wrong tensors silently, and Gloo
aborts the process that receives a larger message than it expects. Reductions may also
come in a different order on different ranks (a unit whose backward runs later on one rank).

Note [wire precision]: with a codec (shardwise.core.codecs; the unit's ``Comm`` policy) a message
is encoded just before it leaves and decoded just after it arrives; whatever stays on a rank is
never encoded, except where ranks must agree. A gather hands out every rank's shard decoded,
this rank's own too, so every rank computes on the same full parameters. A reduce-scatter
sends each rank its encoded row and sums the decoded rows it receives into its own row in fp32
(an all-to-all: nothing is encoded twice, as a ring would at every hop); with a residual
(error feedback) each outgoing row first gets what encoding dropped from it last time, and
keeps what is dropped now. An all-reduce is that reduce-scatter of its N chunks, then a gather
of the encoded sums, decoded on every rank alike; of two ranks (hybrid sharding's two nodes),
a gather of the two encoded tensors, summed decoded in rank order on both: the same bytes in
one trip instead of two. Bytes booked are the messages' bytes, scales
included. On Gloo the all-reduce's second half is posted by a thread of its own once the first
is in (its peers may finish their first halves in another order); on NCCL (untested: no GPU
here) both halves are torch's own collectives on uint8 buffers, the second issued at the wait.

Note [fake world]: the planner runs the real runtime as rank 0 of N ranks in one process, on
fake tensors over torch's "fake" process group, which sends nothing (``groups.fake_world``).
There, that group takes the paths of the backend the plan is for (Gloo's rows or NCCL's
buffer: ``groups.stands_for()``, set by the fake world, which groups owns); inside
``apart()`` collectives count, number their channels and record their flight apart from this
process's own, which stay as they were; and the step check agrees at once (one process
stands for every rank, and fake tensors hold no values to read).
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import events, flight, groups
from .codecs import Codec
from .errors import ShardwiseError

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# replicate_all_reduce: hybrid sharding's all-reduce of gradient shards across the shard groups;
# replica_groups_all_reduce: the one across replica groups outside the job (replica_groups.py);
# weight_sync: weights handed from this rank to an inference engine (shardwise.rl), booked as sent
KINDS = (
    "all_gather", "reduce_scatter", "all_reduce", "replicate_all_reduce", "replica_groups_all_reduce", "broadcast",
    "step_check", "weight_sync",
)


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

    __slots__ = ("works", "finish", "kind", "label", "t_issue", "nbytes", "result", "record", "buffers", "_done")

    def __init__(
        self, works: list, finish, kind: str, label: str, t_issue: float, nbytes: int, result, record, buffers=None
    ):
        self.works, self.finish, self.kind, self.label = works, finish, kind, label
        self.t_issue, self.nbytes, self.result, self.record = t_issue, nbytes, result, record
        self.buffers = buffers
        self._done = not works
        if self._done and record is not None:
            record.done = True

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
        except ShardwiseError:  # named already (replica groups outside the job: replica_groups.py)
            raise
        except Exception as exc:  # Gloo raises on peer death and on timeout
            raise flight.diagnose(self.record, _cause(exc)) from exc
        self.record.done = True
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


def book_sent(kind: str, nbytes: int, payload_bytes: int, seconds: float, wait_seconds: float) -> None:
    """Book one transfer this rank made outside the process groups (a push to an inference
    engine): ``nbytes`` on the wire, standing for ``payload_bytes`` of dense tensors, over
    ``seconds``, ``wait_seconds`` of them blocked on the receiver."""
    s = _stats[kind]
    s.calls += 1
    s.bytes += nbytes
    s.payload_bytes += payload_bytes
    s.seconds += seconds
    s.wait_seconds += wait_seconds


def _cause(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else repr(exc)
    return f"{type(exc).__name__}: {text}; another rank died, raised, or issued other collectives"


def _book(kind: str, nbytes_full: int, world: int, factor: int = 1) -> None:
    s = _stats[kind]
    s.calls += 1
    s.payload_bytes += nbytes_full
    s.bytes += factor * nbytes_full * (world - 1) // world


def book_alone(kind: str, label: str, numel: int, dtype: torch.dtype) -> None:
    """Book and record a collective over a group of one that the caller did itself (its
    copy): counted and recorded as one issued and done, with nothing sent."""
    flight.record(kind, label, numel, dtype).done = True
    _book(kind, numel * dtype.itemsize, 1)


def _issue(
    kind: str, label: str, nbytes: int, tensor: torch.Tensor, start, buffers=None, numel: int | None = None
) -> Pending:
    """Record the collective, then ``start()`` it; it returns a work, or (works, completion
    step, result). The pending collective holds ``buffers`` until its wait. Its record notes
    ``numel`` (default: the tensor's), which must be the same on every rank."""
    record = flight.record(kind, label, tensor.numel() if numel is None else numel, tensor.dtype)
    t0 = time.perf_counter()
    try:
        issued = start()
    except (torch.OutOfMemoryError, ShardwiseError):  # its buffers, or named already: as it is
        raise
    except Exception as exc:
        raise flight.diagnose(record, _cause(exc)) from exc
    works, finish, result = issued if isinstance(issued, tuple) else ([issued], None, None)
    return Pending(works, finish, kind, label, t0, nbytes, result, record, buffers)


@contextlib.contextmanager
def apart():
    """Inside, collectives count, number channels and record their flight apart from the
    caller's, which are as they were afterwards (the planner's fake world: Note [fake world])."""
    global _stats, _channels
    saved = _stats, _channels
    _stats = {k: CollectiveStats() for k in KINDS}
    try:
        with flight.apart():
            yield
    finally:
        _stats, _channels = saved


def on_gloo(group) -> bool:
    """Whether collectives over ``group`` take Gloo's paths (the backend the planner's fake
    group stands for, there); False for a group of one."""
    if dist.get_world_size(group) == 1:
        return False
    backend = groups.backend(group)
    if backend == "fake" and groups.stands_for() is not None:
        backend = groups.stands_for()
    return backend == dist.Backend.GLOO


def _global_rank(group, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


_channels = 0


def channel() -> int:
    """A new channel number for one unit's gathers and reductions (Note [tagged Gloo messages]).

    Ranks create units in the same order (``shard()`` is collective), so a unit gets the same
    number on every rank."""
    global _channels
    _channels += 1
    return _channels


# the message kinds of a channel: a gather, a reduce-scatter, and an encoded all-reduce's two
# halves (of two ranks: its one gather is the second's)
_GATHER, _REDUCE, _ALL_REDUCE_SUMS, _ALL_REDUCE_GATHER = range(4)


def _tag(channel: int, kind: int) -> int:
    return (4 * channel + kind) & 0x7FFFFFFF


def _exchange(sends: list[torch.Tensor], recvs: list[torch.Tensor | None], group, tag: int) -> list:
    """Send ``sends[r]`` to every other rank r and receive its message into ``recvs[r]``,
    asynchronously, in ring order (this rank's successors first), posted by the posting
    thread (Note [posting thread]); in the planner's fake world, here."""
    if groups.stands_for() is not None:  # (fake tensors live in this thread's FakeTensorMode)
        return _post(sends, recvs, group, tag)
    poster = _posters.get(group)
    if poster is None:
        poster = _posters[group] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-post")
    return [_Posted(poster.submit(_post, sends, recvs, group, tag))]


# Note [posting thread]: Gloo writes a point-to-point message into the socket on the thread that
# posts it when the receiver is already waiting for it (as it usually is: ranks post their
# receives when they issue the collective), which is megabytes of copying on the compute
# thread (docs/benchmarks.md measured +8% on a step). One thread per process group posts its
# messages instead, in the order they are issued (messages of a tag are matched in order), and
# the copying happens there, beside compute, as Gloo's own collectives do it on their worker
# threads. A thread per group, not one for all: a write over a slow link between nodes (hybrid
# sharding's replica group, encoded) blocks its thread for as long as the link takes, and
# must not hold up the gathers within a node behind it (measured: docs/benchmarks.md).
_posters: dict = {}  # process group -> its posting thread


def _post(sends: list[torch.Tensor], recvs: list[torch.Tensor | None], group, tag: int) -> list:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    works = []
    for step in range(1, world):
        to, frm = (rank + step) % world, (rank - step) % world
        works.append(dist.irecv(recvs[frm], _global_rank(group, frm), group=group, tag=tag))
        works.append(dist.isend(sends[to], _global_rank(group, to), group=group, tag=tag))
    return works


class _Posted:
    """The works of messages the posting thread posts, as one work."""

    __slots__ = ("future",)

    def __init__(self, future: Future):
        self.future = future

    def wait(self) -> bool:
        for work in self.future.result():
            work.wait()
        return True

    def is_completed(self) -> bool:
        return self.future.done() and all(w.is_completed() for w in self.future.result())


def all_gather(
    shard: torch.Tensor,
    group,
    label: str,
    channel: int,
    sizes: tuple[int, ...] | None = None,
    codec: Codec | None = None,
    into: torch.Tensor | None = None,
) -> Pending:
    """Gather every rank's ``shard``, asynchronously; after ``wait()``, ``result[r]`` is rank
    r's shard (on Gloo ``result[rank]`` is ``shard`` itself: read it, don't write it).
    ``sizes[r]`` is rank r's element count where ranks hold different amounts (owned
    parameters, Note [placement] in layout.py); None: all hold as many as this rank.
    ``into`` (Gloo, no codec): memory of the caller's for the result, ``sum(sizes)`` elements
    whose rank-r piece becomes ``result[r]``; ``shard`` must be this rank's piece of it.

    Gloo: this rank's shard goes from where it lies to every other rank, and theirs into N-1
    receive rows of their sizes (Note [Gloo gather and reduce-scatter]). Otherwise one
    all-gather into a rank-major tensor, handed out whole so that the copy-out is one kernel;
    with ragged sizes every rank's row is padded to the largest.

    codec: encode the shards on the wire; every row of the result, this rank's included, is
    then a decoded shard in ``shard``'s dtype (Note [wire precision]).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = shard.view(-1)
    sizes = sizes if sizes is not None else (mine.numel(),) * world
    gloo = on_gloo(group)
    if into is not None:
        _check_into(into, mine, sizes, rank, (gloo or world == 1) and codec is None)
    if codec is not None and world > 1:
        return _all_gather_encoded(mine, group, label, channel, sizes, codec, gloo)
    _book_ragged("all_gather", sizes, rank, shard.element_size(), padded=not gloo)
    nbytes = sum(sizes) * shard.element_size()

    def start():
        if world == 1:
            return [], None, [mine]
        if gloo:
            if into is not None:
                rows = list(into.view(-1).split(list(sizes)))
            else:
                others = [n for r, n in enumerate(sizes) if r != rank]
                rows = list(mine.new_empty(sum(others)).split(others))  # one allocation
                rows.insert(rank, mine)
            return _exchange([mine] * world, rows, group, _tag(channel, _GATHER)), None, rows
        widest = max(sizes)
        send = mine if mine.numel() == widest else torch.cat([mine, mine.new_zeros(widest - mine.numel())])
        out = mine.new_empty(world, widest)  # one rank-major tensor: its rows index by rank
        return [_all_gather_tensor(out, send, group=group, async_op=True)], None, out

    return _issue("all_gather", label, nbytes, shard, start, numel=max(sizes))


def _check_into(into: torch.Tensor, mine: torch.Tensor, sizes: tuple[int, ...], rank: int, supported: bool) -> None:
    if not supported:
        raise ValueError("all_gather(into=...) takes a Gloo group and no codec")
    first = sum(sizes[:rank])
    # (fake tensors, in the planner's world, have no addresses to compare)
    placed = groups.stands_for() is not None or into.view(-1)[first:].data_ptr() == mine.data_ptr()
    if into.numel() != sum(sizes) or into.dtype != mine.dtype or not placed:
        raise ValueError(
            f"all_gather(into=...): give {sum(sizes)} elements of {mine.dtype} with the shard at element {first}"
        )


def _book_ragged(kind: str, sizes: tuple[int, ...], rank: int, itemsize: int, padded: bool) -> None:
    """Book a gather or reduce-scatter whose ranks hold ``sizes`` elements: a rank receives
    (gather) or sends (reduce-scatter) every other rank's share, so over all ranks (N-1) times
    the whole moves, (N-1)/N of it per rank on average as for a ring; padded to the largest
    share where the backend needs equal rows (NCCL)."""
    world = len(sizes)
    if padded or len(set(sizes)) == 1:
        _book(kind, world * max(sizes) * itemsize, world)
        return
    s = _stats[kind]
    s.calls += 1
    s.payload_bytes += sum(sizes) * itemsize
    s.bytes += (sum(sizes) - sizes[rank]) * itemsize


@dataclass
class ScatterRows:
    """The buffers of one reduce-scatter (``scatter_rows``).

    Fill ``rows[r]`` with this rank's contribution to rank r's sum, then ``reduce_scatter``;
    ``out`` holds this rank's sum after the wait. On Gloo ``out`` is this rank's own row,
    summed in place, and the other rows are sent as they are.
    """

    rows: list[torch.Tensor]
    out: torch.Tensor
    full: torch.Tensor | None  # the rows as one rank-major tensor, where the backend needs it


def scatter_rows(sizes: tuple[int, ...], dtype: torch.dtype, device: torch.device, group) -> ScatterRows:
    """Fresh buffers for a reduce-scatter over ``group`` in which rank r's sum has
    ``sizes[r]`` elements (see ``ScatterRows``; ragged where ranks own whole parameters)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        out = torch.empty(sizes[0], dtype=dtype, device=device)
        return ScatterRows([out], out, None)
    if on_gloo(group):
        # ``out`` is an allocation of its own: the gradient shards are views of it and keep it
        out = torch.empty(sizes[rank], dtype=dtype, device=device)
        others = [n for r, n in enumerate(sizes) if r != rank]
        rows = list(torch.empty(sum(others), dtype=dtype, device=device).split(others))  # the rows it sends
        rows.insert(rank, out)
        return ScatterRows(rows, out, None)
    widest = max(sizes)  # NCCL: equal rows, padded to the largest (the padding's sums are unused)
    full = torch.empty(world, widest, dtype=dtype, device=device)
    out = torch.empty(widest, dtype=dtype, device=device)
    rows = full.unbind(0) if min(sizes) == widest else [row[:n] for row, n in zip(full.unbind(0), sizes)]
    return ScatterRows(list(rows), out, full)


def reduce_scatter(
    buf: ScatterRows,
    group,
    label: str,
    channel: int,
    codec: Codec | None = None,
    residual: torch.Tensor | None = None,
) -> Pending:
    """Sum the filled ``buf.rows`` over ranks into ``buf.out``, asynchronously (the other
    rows are scratch afterwards). Where a row is a whole owned parameter's gradient, this is
    a reduce to its owner.

    Gloo: each row goes to its rank, the others' rows for this rank arrive in N-1 receive
    rows and are added to ``out`` at the wait. Otherwise one reduce-scatter.

    codec: encode the rows on the wire; the decoded rows are summed in fp32. residual: error
    feedback, laid out as the rows one after another (Note [wire precision]).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if codec is not None and world > 1:
        return _reduce_scatter_encoded(buf, group, label, channel, codec, residual)
    sizes = tuple(r.numel() for r in buf.rows)
    itemsize = buf.out.element_size()
    _book_ragged("reduce_scatter", sizes, rank, itemsize, padded=buf.full is not None)
    nbytes = sum(sizes) * itemsize
    held = [buf.rows, buf.full]  # every buffer it uses, held by the pending collective

    def start():
        if world == 1:
            return [], None, None
        if buf.full is None:
            recv = list(buf.out.new_empty(world - 1, buf.out.numel()).unbind(0))
            recv.insert(rank, None)
            held.append(recv)
            works = _exchange(buf.rows, recv, group, _tag(channel, _REDUCE))

            def add_received():
                for r in range(world):
                    if r != rank:
                        buf.out.add_(recv[r])

            return works, add_received, None
        return [_reduce_scatter_tensor(buf.out, buf.full, group=group, async_op=True)], None, None

    return _issue("reduce_scatter", label, nbytes, buf.out, start, buffers=held, numel=max(sizes))


def all_reduce(
    tensor: torch.Tensor,
    group,
    label: str,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    kind: str = "all_reduce",
    numel: int | None = None,
    codec: Codec | None = None,
    channel: int = 0,
    residual: torch.Tensor | None = None,
) -> Pending:
    """Reduce ``tensor`` in place over ranks, asynchronously (booked as ``kind``; ``numel``
    is what the flight record notes where ranks of other groups reduce other sizes).

    codec: a sum with encoded messages on the unit's ``channel``, and error feedback in
    ``residual`` (shaped like ``tensor``), as Note [wire precision] says.
    """
    world = dist.get_world_size(group)
    if codec is not None and world > 1:
        assert op == dist.ReduceOp.SUM, f"rank {dist.get_rank()}: an encoded all-reduce sums"
        return _all_reduce_encoded(tensor, group, label, kind, numel, codec, channel, residual)
    _book(kind, tensor.numel() * tensor.element_size(), world, factor=2)
    nbytes = tensor.numel() * tensor.element_size()
    return _issue(
        kind, label, nbytes, tensor, lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True), numel=numel
    )


def replica_groups_all_reduce(tensor: torch.Tensor, replica_groups, label: str, numel: int | None = None) -> Pending:
    """Average ``tensor`` in place over the replica groups outside the job that take part in
    this step (``replica_groups.ReplicaGroups``), asynchronously; booked as ``replica_groups_all_reduce``, a
    ring's 2 (P-1)/P of the tensor for P groups. ``numel`` is what the flight record notes
    where the job's ranks reduce other sizes (owned parameters)."""
    nbytes = tensor.numel() * tensor.element_size()

    def start():
        work = replica_groups.all_reduce(tensor)
        _book("replica_groups_all_reduce", nbytes, max(1, replica_groups.size()), factor=2)
        return work

    return _issue("replica_groups_all_reduce", label, nbytes, tensor, start, numel=numel)


def broadcast(tensor: torch.Tensor, src_rank: int, group, label: str, numel: int | None = None) -> Pending:
    """Copy ``tensor`` from group rank ``src_rank`` to every rank, asynchronously (``numel``:
    what the flight record notes where ranks of other groups broadcast other sizes)."""
    world = dist.get_world_size(group)
    _book("broadcast", tensor.numel() * tensor.element_size(), world)
    nbytes = tensor.numel() * tensor.element_size()
    src = _global_rank(group, src_rank)
    return _issue(
        "broadcast", label, nbytes, tensor, lambda: dist.broadcast(tensor, src, group=group, async_op=True),
        numel=numel,
    )


def broadcast_object(obj, src_rank: int, group, label: str):
    """Group rank ``src_rank``'s ``obj`` (picklable) on every rank of ``group`` (a host
    group), blocking: its pickled length, then its bytes, both counted and recorded; the
    bytes' record notes no size (0), as ranks of other groups send other objects."""
    mine = dist.get_rank(group) == src_rank
    data = pickle.dumps(obj) if mine else b""
    length = torch.tensor([len(data)], dtype=torch.int64)
    broadcast(length, src_rank, group, label).wait()
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if mine else torch.empty(int(length), dtype=torch.uint8)
    broadcast(payload, src_rank, group, label, numel=0).wait()
    return obj if mine else pickle.loads(payload.numpy().tobytes())


# --- encoded collectives (Note [wire precision])
def _all_gather_encoded(mine, group, label, channel, sizes, codec: Codec, gloo: bool) -> Pending:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    lengths = tuple(codec.nbytes(n) for n in sizes)
    _book_encoded("all_gather", lengths, rank, gloo)
    rows: list[torch.Tensor | None] = [None] * world
    held: list = []

    def start():
        works, received = _gather_messages(codec.encode(mine), lengths, group, _tag(channel, _GATHER), gloo, held)

        def decode() -> None:
            for r in range(world):
                rows[r] = codec.decode(received[r], sizes[r]).to(mine.dtype)

        return works, decode, rows

    return _issue("all_gather", label, sum(lengths), mine, start, buffers=held, numel=max(sizes))


def _reduce_scatter_encoded(buf: ScatterRows, group, label, channel, codec: Codec, residual) -> Pending:
    rank = dist.get_rank(group)
    sizes = tuple(r.numel() for r in buf.rows)
    lengths = tuple(codec.nbytes(n) for n in sizes)
    gloo = buf.full is None
    _book_encoded("reduce_scatter", lengths, rank, gloo)
    held: list = [buf.rows, buf.full]

    def start():
        messages = _encode_rows(buf.rows, rank, codec, residual)
        works, received = _send_messages(messages, lengths, group, _tag(channel, _REDUCE), gloo, held)

        def add_received() -> None:
            _sum_into(buf.rows[rank], received, rank, codec, buf.out)

        return works, add_received, None

    return _issue("reduce_scatter", label, sum(lengths), buf.out, start, buffers=held, numel=max(sizes))


def _all_reduce_encoded(tensor, group, label, kind, numel, codec: Codec, channel, residual) -> Pending:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 2:
        return _all_reduce_pair(tensor, group, label, kind, numel, codec, channel, residual)
    flat = tensor.view(-1)
    per = -(-flat.numel() // world)
    chunks = [flat[min(r * per, flat.numel()) : min((r + 1) * per, flat.numel())] for r in range(world)]
    lengths = tuple(codec.nbytes(c.numel()) for c in chunks)
    gloo = on_gloo(group)
    s = _stats[kind]  # its chunks go out encoded, and every other rank's encoded sum comes in
    s.calls += 1
    s.payload_bytes += sum(lengths)
    s.bytes += 2 * (sum(lengths) - lengths[rank])
    held: list = []
    gathered: list = []

    def gather_sums(received) -> list:
        """After the first half: sum this rank's chunk, then send it to every rank."""
        own = chunks[rank]
        _sum_into(own, received, rank, codec, own)
        works, rows = _gather_messages(
            codec.encode(own), lengths, group, _tag(channel, _ALL_REDUCE_GATHER), gloo, held
        )
        gathered.extend(rows)
        return works

    def decode() -> None:
        for c, message in zip(chunks, gathered):
            c.copy_(codec.decode(message, c.numel()))

    def start():
        messages = _encode_rows(chunks, rank, codec, residual)
        works, received = _send_messages(messages, lengths, group, _tag(channel, _ALL_REDUCE_SUMS), gloo, held)
        if gloo and groups.stands_for() is None:

            def second_half() -> list:
                for w in works:
                    w.wait()
                return gather_sums(received)

            return [_Posted(_on_own_thread(second_half))], decode, None

        def finish() -> None:  # NCCL, and the fake world: the second half is issued here
            for w in works:
                w.wait()
            for w in gather_sums(received):
                w.wait()
            decode()

        return works, finish, None

    return _issue(kind, label, sum(lengths), tensor, start, buffers=held, numel=numel)


def _all_reduce_pair(tensor, group, label, kind, numel, codec: Codec, channel, residual) -> Pending:
    """The encoded all-reduce of two ranks: each sends the other its whole tensor encoded and
    both sum the two decoded messages in rank order (the same bytes as the two halves, in one
    trip over the link, rounded once)."""
    flat = tensor.view(-1)
    length = codec.nbytes(flat.numel())
    gloo = on_gloo(group)
    s = _stats[kind]
    s.calls += 1
    s.payload_bytes += length
    s.bytes += length
    held: list = []

    def start():
        message = _encode_rows([flat], -1, codec, residual)[0]
        works, messages = _gather_messages(message, (length, length), group, _tag(channel, _ALL_REDUCE_GATHER), gloo, held)

        def finish() -> None:
            total = codec.decode(messages[0], flat.numel())
            total.add_(codec.decode(messages[1], flat.numel()))
            flat.copy_(total)

        return works, finish, None

    return _issue(kind, label, length, tensor, start, buffers=held, numel=numel)


def _encode_rows(rows: list[torch.Tensor], skip: int, codec: Codec, residual: torch.Tensor | None) -> list:
    """The message of each row but ``rows[skip]`` (None there). With a residual (the rows'
    error feedback, laid out as the rows one after another) a row first gets its residual
    added (the rows are scratch), then keeps in it what encoding dropped."""
    messages, start = [], 0
    for r, row in enumerate(rows):
        n = row.numel()
        if r == skip:
            messages.append(None)
        elif residual is None:
            messages.append(codec.encode(row))
        else:
            kept = residual[start : start + n]
            row.add_(kept.view_as(row))
            message = codec.encode(row)
            torch.sub(row.view(-1), codec.decode(message, n), out=kept)
            messages.append(message)
        start += n
    return messages


def _sum_into(own: torch.Tensor, received: list, rank: int, codec: Codec, out: torch.Tensor) -> None:
    """``out`` = ``own`` + every received message but this rank's, decoded; summed in fp32."""
    total = own.float()  # (``own`` itself where it is fp32)
    for r, message in enumerate(received):
        if r != rank:
            total.add_(codec.decode(message, own.numel()).view_as(total))
    if total is not out:
        out.view(-1)[: own.numel()].copy_(total.view(-1))


def _aligned(nbytes: int) -> int:
    """Row width of a rank-major uint8 buffer whose rows must hold fp32 scales."""
    return -(-nbytes // 4) * 4


def _book_encoded(kind: str, lengths: tuple[int, ...], rank: int, gloo: bool) -> None:
    _book_ragged(kind, lengths if gloo else (_aligned(max(lengths)),) * len(lengths), rank, 1, padded=not gloo)


def _send_messages(messages: list, lengths: tuple[int, ...], group, tag: int, gloo: bool, held: list):
    """Send ``messages[r]`` to each other rank r, and receive each other rank's message for
    this one (``lengths[r]``: the bytes of rank r's message, known on every rank): works, and
    the messages received (None at this rank's place)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = next(m for m in messages if m is not None).device
    if gloo:
        received = [
            None if r == rank else torch.empty(lengths[rank], dtype=torch.uint8, device=device) for r in range(world)
        ]
        held.append(received)
        return _exchange(messages, received, group, tag), received
    send = torch.zeros(world, _aligned(max(lengths)), dtype=torch.uint8, device=device)
    for r, m in enumerate(messages):
        if m is not None:
            send[r, : m.numel()].copy_(m)
    out = torch.empty_like(send)
    held += [send, out]
    return [dist.all_to_all_single(out, send, group=group, async_op=True)], list(out.unbind(0))


def _gather_messages(message: torch.Tensor, lengths: tuple[int, ...], group, tag: int, gloo: bool, held: list):
    """Send this rank's ``message`` to every other rank and receive theirs: works, and every
    rank's message, this rank's own included."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if gloo:
        received = [message if r == rank else message.new_empty(n) for r, n in enumerate(lengths)]
        held.append(received)
        return _exchange([message] * world, received, group, tag), received
    widest = _aligned(max(lengths))
    send = F.pad(message, (0, widest - message.numel()))
    out = message.new_empty(world, widest)
    held += [send, out]
    return [_all_gather_tensor(out, send, group=group, async_op=True)], list(out.unbind(0))


def _on_own_thread(fn: Callable[[], list]) -> Future:
    """Run ``fn`` on a thread of its own: it waits for messages that peers may send in any
    order relative to other units', so it cannot share a thread with another such wait."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except Exception as exc:  # raised again at the collective's wait
            future.set_exception(exc)

    threading.Thread(target=run, name="shardwise-all-reduce", daemon=True).start()
    return future


def blocking(kind: str, label: str, fn, *args, **kwargs):
    """Run one of torch.distributed's own blocking calls (object collectives, a barrier, a
    training loop's loss all-reduce) so that a failure, a peer that died say, ends this rank
    with a ``CollectiveError`` naming where each rank was, as shardwise's own collectives do.
    Not counted in ``comm_stats`` and kept out of the flight recorder's ring and digest: some
    run on a thread of their own (a background checkpoint save) or on some ranks only."""
    record = flight.Record(-1, kind, label, 0, "object")
    try:
        out = fn(*args, **kwargs)
    except Exception as exc:
        raise flight.diagnose(record, _cause(exc)) from exc
    record.done = True
    return out


def agree(problem: str, label: str, error: Callable[[str], Exception], *, group=None, value=None):
    """Decide on rank 0, raise on every rank: rank 0's ``problem`` ("" when all is well; the
    other ranks' is not read) and ``value`` reach every rank of ``group`` (None: the world,
    whose rank 0 decides; else the group's first rank). A ``problem`` raises ``error(message)``
    on every rank, so none waits on a collective the others left: the message is ``problem``
    on the deciding rank and names it on the others. Returns the deciding rank's ``value``."""
    box = [(problem, value)]
    if dist.get_world_size(group) > 1:
        src = 0 if group is None else dist.get_global_rank(group, 0)
        blocking("broadcast", label, dist.broadcast_object_list, box, src=src, group=group)
    problem, value = box[0]
    if problem:
        raise error(problem if dist.get_rank(group) == 0 else f"{problem} (reported by rank 0)")
    return value


def step_check_nbytes(num_flags: int) -> int:
    """Bytes of the tensor one step check all-reduces for ``num_flags`` trained parameters."""
    return 8 * (num_flags + 2)


def step_check(flags: list[bool], group, buffer: torch.Tensor) -> Callable[[], list[bool]]:
    """Agree once per step, over the host group ``group``, on which parameters got a gradient
    on any rank and on the sequence of collectives since the last check.

    One small all-reduce (max) of this rank's flags and of its digest of the collectives it
    issued (``flight.take_digest``), negated too, so that the maximum of both tells whether
    every rank's digest is the same. ``buffer`` (int64, ``len(flags) + 2``) is the caller's,
    reused every step: a fresh one's last reference could go on the collective's worker
    thread, where memory tools do not see it freed. Issued at once; the returned function
    waits and returns whether each parameter got a gradient on any rank, or raises
    ``CollectiveError`` on every rank, naming where the ranks parted, when the digests differ.
    """
    digest = flight.take_digest()
    buffer.copy_(torch.tensor([*flags, digest, -digest], dtype=torch.int64))
    world = dist.get_world_size(group)
    _book("step_check", step_check_nbytes(len(flags)), world, factor=2)
    pending = _issue(
        "step_check", "<step check>", buffer.numel() * buffer.element_size(), buffer,
        lambda: dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=group, async_op=True),
    )

    def result() -> list[bool]:
        pending.wait()
        if groups.stands_for() is not None:  # one process stands for every rank: they agree
            return list(flags)
        agreed = buffer.tolist()
        if agreed[-2] != digest or -agreed[-1] != digest:
            raise flight.diagnose(None, "ranks issued different collectives in this step")
        return [f > 0 for f in agreed[:-2]]

    return result
