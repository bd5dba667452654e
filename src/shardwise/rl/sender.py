"""The "shardwise" backend on the trainer's side (vLLM's ``TrainerWeightTransferEngine``) and
the sharded model as vLLM's ``WeightSource``.

Every trainer rank runs ``trainer_init`` and ``send_weights``; rank 0 is the sender. A push
walks the units in order (``source.by_unit``). Full mode: each unit is gathered once over its
group and rank 0 packs its tensors into buckets. Delta mode (after a full push): each rank
compares its own rows with what it pushed last, without a gather, and rank 0 collects the
changes. Rank 0 hands every full bucket to a thread that makes the engine's
``update_weights`` call while the next bucket fills (two staging buffers alternate).

Before each unit every rank learns from rank 0 whether the engine has failed (one small
broadcast), so a dead engine ends the push on all ranks at the next unit, and the outcome is
agreed at the end: a failure raises ``EngineError`` on every rank.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerWeightTransferEngine,
    WeightSource,
)

from ..checkpoint.state import idle_world_runtime
from ..core import collectives as C
from ..core.runtime import require_idle
from . import packing
from .clients import EngineError
from .delta import Patch, Shadow
from .init_info import ShardwiseTrainerInitInfo
from .source import Export, Gathered, Live, Scratch, by_unit, exports, local_rows
from .transport import transport


class ShardwiseSource(WeightSource):
    """A sharded model's weights for an engine, in ``save_pretrained``'s names (LoRA merged),
    read unit by unit. Iterating it is collective (every rank, in lockstep): each unit is
    gathered once and its tensors are handed out whole, in the wire dtype."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = torch.bfloat16):
        self.rt = idle_world_runtime(model, "VLLMSync")
        self.exports = exports(model, dtype)
        self.groups = by_unit(self.exports)

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(e.name, e.dtype, e.shape) for e in self.exports]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.rt.mesh.in_first_shard_group():
            return
        scratch, view = Scratch(), Live(self.rt)
        with view.reading(), torch.no_grad():
            for unit, exps in self.groups:
                gathered = Gathered(view, unit, exps, scratch) if unit is not None else None
                for e in exps:
                    out = torch.empty(e.numel, dtype=e.dtype, device=self.rt.device)
                    segments = gathered.segments(e) if gathered else [(0, e.buffer.detach().view(-1))]
                    for start, seg in segments:
                        out[start : start + seg.numel()].copy_(seg)
                    yield e.name, out.view(e.shape)


@dataclass
class Feed:
    """One engine a trainer rank feeds: its client (``clients.Watched``), a name for errors
    ("" with a single engine) and, once connected, the writer of its link."""

    client: object
    label: str = ""
    writer: object = None


class ShardwiseTrainerWeightTransferEngine(TrainerWeightTransferEngine[ShardwiseTrainerInitInfo]):
    """Built on every trainer rank; ``client``: the ``Feed``s of the engines this rank feeds
    (none on most ranks, one or more on the first ranks when several engines take a push)."""

    init_info_cls = ShardwiseTrainerInitInfo

    def __init__(self, *, client: list[Feed], source: ShardwiseSource, info: ShardwiseTrainerInitInfo):
        super().__init__(client=client, source=source, is_sender=bool(client))
        self.info = info
        self.feeds = client
        self.shadow = Shadow()
        self.index = {e.name: i for i, e in enumerate(source.exports)}  # the shadow's keys
        self.scratch = Scratch()  # every rank's gathers, on CPU; kept until shutdown
        self.pause_seconds = 0.0  # the longest an engine this rank feeds stopped serving, last push

    @classmethod
    def trainer_init(cls, init_info: ShardwiseTrainerInitInfo, *, client, source=None):
        if not isinstance(source, ShardwiseSource):
            raise ValueError("the shardwise backend takes a ShardwiseSource (a sharded model)")
        engine = cls(client=list(client), source=source, info=init_info)
        problems = []
        for i, feed in enumerate(engine.feeds):
            try:
                engine._handshake(feed, i)
            except Exception as e:
                problems.append(feed.label + _problem(e))
        if problems:
            engine.shutdown()
        _agree("; ".join(problems), "the engine refused the handshake")
        return engine

    def _handshake(self, feed: Feed, i: int) -> None:
        info = self.info
        link = replace(info, port=info.port + i if info.port else 0, workers=info.workers[i])
        feed.writer = transport(info.transport).writer(link)
        declared = [[e.name, packing.dtype_name(e.dtype), list(e.shape)] for e in self.source.exports]
        payload = {**feed.writer.init_info(), "tensors": declared, "delta": info.delta, "timeout": info.timeout}
        # tcp: both sides join the group at once. The engine checks the names first and
        # joins only if they fit; a refused handshake leaves the joining thread to time out.
        joined: Future = Future()
        threading.Thread(target=_run_into, args=(feed.writer.connect, joined), daemon=True).start()
        feed.client.init_weight_transfer_engine(payload)
        joined.result(timeout=info.timeout)
        feed.writer.connected()

    def send_weights(self, version: int = 0, view: Live | None = None) -> None:
        """Push every weight (full) or what changed (delta, after a full push) to every engine;
        collective. Each engine's update is committed only when every engine got all of it:
        otherwise every one is aborted. ``view``: what is read (default: the units as they
        are, between steps; a ``Frozen`` copy on a thread beside training)."""
        src, rt = self.source, self.source.rt
        if view is None:
            require_idle(rt, "VLLMSync.push")
            view = Live(rt)
        delta = self.info.delta and self.shadow.valid
        payload = sum(e.nbytes for e in src.exports)
        senders = [_Sender(f, version, payload, self.info.delta) for f in self.feeds]
        reads = rt.mesh.in_first_shard_group()
        problems = []
        try:
            with view.reading(), torch.no_grad():
                for unit, exps in src.groups:
                    if _any_failed(senders, view.control):
                        break
                    if not reads:
                        continue
                    if delta:
                        self._delta_unit(view, unit, exps, senders)
                    else:
                        self._full_unit(view, unit, exps, senders)
                for sender in senders:
                    sender.guard(sender.drain)
                if _any_failed(senders, view.control):  # every engine's update, or none
                    for sender in senders:
                        sender.guard(_raise, EngineError("another engine's update failed: this one is aborted too"))
                for sender in senders:
                    sender.guard(sender.commit)
        finally:
            problems = [p for p in (s.close() for s in senders) if p]
            self.pause_seconds = max((s.paused for s in senders), default=0.0)
        try:
            _agree("; ".join(problems), f"push of version {version} failed", view.control)
        except EngineError:
            self.shadow.reset()  # what the engines hold is unknown: the next push is a full one
            raise
        self.shadow.valid = self.info.delta

    def _full_unit(self, view: Live, unit: int | None, exps: list[Export], senders: list[_Sender]) -> None:
        gathered = Gathered(view, unit, exps, self.scratch) if unit is not None else None
        for e in exps:
            for sender in senders:
                segments = gathered.segments(e) if gathered else [(0, view.buffer(e).view(-1))]
                sender.guard(sender.packer.dense, e.name, e.dtype, e.shape, segments)
            if self.info.delta:
                rows = local_rows(view, e, gathered)
                if rows is not None:
                    self.shadow.store(self.index[e.name], rows[1], e.dtype)

    def _delta_unit(self, view: Live, unit: int | None, exps: list[Export], senders: list[_Sender]) -> None:
        gathered = None
        if unit is not None and any(e.lora is not None for e in exps):
            gathered = Gathered(view, unit, exps, self.scratch)
        mine = []
        for e in exps:
            rows = local_rows(view, e, gathered)
            if rows is not None:
                mine += self.shadow.patch(self.index[e.name], rows[0], rows[1], e.dtype)
        patches = _gather_patches(mine, view.group(unit), everywhere=self.info.feeders > 1)
        for p in patches if senders else []:
            e = self.source.exports[p.export]
            for sender in senders:
                if p.indices is None:
                    sender.guard(sender.packer.dense, e.name, e.dtype, e.shape, [(p.first, p.values)])
                else:
                    sender.guard(sender.packer.sparse, e.name, e.dtype, e.shape, p.indices, p.values, p.steps)

    def shutdown(self) -> None:
        for feed in self.feeds:
            if feed.writer is not None:
                feed.writer.close()
                feed.writer = None
        self.shadow.reset()
        self.scratch = Scratch()


class _Sender:
    """A feeding rank's half of a push to one engine: packs buckets and ships each on a
    thread (the engine's ``update_weights`` call, and the transfer itself over tcp) while the
    next one fills. A failure anywhere is kept in ``error``; later steps are skipped and every
    rank learns of it at the next unit."""

    def __init__(self, feed: Feed, version: int, payload: int, delta: bool):
        self.client, self.writer, self.label = feed.client, feed.writer, feed.label
        self.version, self.payload, self.delta = version, payload, delta
        self.error: BaseException | None = None
        self.free: queue.Queue = queue.Queue()
        for i in range(len(self.writer.buffers)):
            self.free.put(i)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-push")
        self.packer = packing.Packer(self.acquire, self.ship)
        self.sent = 0
        self.waited = 0.0  # blocked on the engine: a bucket to come back, the finish
        self.started = False
        self.t0 = time.perf_counter()
        self.t_pause = self.t_end = 0.0

    def guard(self, fn, *args) -> None:
        if self.error is not None:
            return
        try:
            fn(*args)
        except BaseException as e:  # kept for every rank to learn of at the next unit
            self.error = e

    def start(self) -> None:
        """Open the engine's update as late as can be, when the first bucket is full, so that
        the gathers before it run while the engine still serves. Full mode: a server stops
        generating from here (layers are replaced as they arrive); delta mode: only for the
        commit (the engine patches its copy of the checkpoint and reloads it there)."""
        self.started = True  # an abort follows even if the start itself failed half-way
        if not self.delta:
            self.t_pause = time.perf_counter()
        self.client.start_weight_update(pause=not self.delta)

    @property
    def paused(self) -> float:
        """Seconds the engine stopped serving for this push (to the end of the commit)."""
        return self.t_end - self.t_pause if self.t_end else 0.0

    def drain(self) -> None:
        """Ship the last bucket and wait until the engine has taken every one."""
        self.packer.flush()
        if not self.started:  # nothing to send (a delta push with no change): a new version all the same
            self.start()
        t0 = time.perf_counter()
        self.pool.shutdown(wait=True)
        self.waited += time.perf_counter() - t0
        if self.error is not None:
            raise self.error

    def commit(self) -> None:
        t0 = time.perf_counter()
        if self.delta:
            self.t_pause = t0
        self.client.finish_weight_update(str(self.version), pause=self.delta)
        self.t_end = time.perf_counter()
        self.waited += self.t_end - t0

    def acquire(self) -> packing.Bucket:
        t0 = time.perf_counter()
        while True:
            if self.error is not None:
                raise self.error
            try:
                i = self.free.get(timeout=0.2)
            except queue.Empty:
                continue
            self.waited += time.perf_counter() - t0
            return packing.Bucket(self.writer.buffers[i], i)

    def ship(self, bucket: packing.Bucket) -> None:
        if not self.started:
            self.start()
        self.pool.submit(self._ship, bucket)

    def _ship(self, bucket: packing.Bucket) -> None:
        if self.error is not None:
            return
        update = {"version": self.version, "bucket": bucket.index, "nbytes": bucket.used, "entries": bucket.entries}
        try:
            self.writer.deliver(lambda: self.client.update_weights(update), bucket.index, bucket.used)
        except BaseException as e:
            self.error = e
            return
        self.sent += bucket.used
        self.free.put(bucket.index)

    def close(self) -> str:
        """End the push to this engine; "" or what went wrong. A push that failed with the
        engine still alive is aborted: delta mode keeps serving the previous version; full mode
        has replaced some layers, so a server stays paused until the next push completes."""
        self.pool.shutdown(wait=self.error is None)
        e = self.error
        if e is None:
            C.book_sent("weight_sync", self.sent, self.payload, time.perf_counter() - self.t0, self.waited)
            return ""
        problem = self.label + _problem(e)
        if self.started:
            try:
                self.client.abort(self.version, resume=self.delta)
            except Exception:
                problem += " (the engine could not be told to abort the update)"
            else:
                problem += " (the engine kept the previous weights)" if self.delta else (
                    " (the engine holds a partial update: generate only after the next push)"
                )
        return problem


def _problem(e: BaseException) -> str:
    return str(e) if isinstance(e, EngineError) else f"{type(e).__name__}: {e}"


def _raise(e: BaseException) -> None:
    raise e


def _run_into(fn, future: Future) -> None:
    try:
        future.set_result(fn())
    except BaseException as e:  # handed to the waiting caller
        future.set_exception(e)


def _any_failed(senders: list[_Sender], group=None) -> bool:
    """Every rank learns whether any rank's push to any engine has failed (one small
    all-reduce over ``group``, the world's)."""
    flag = torch.tensor([int(any(s.error is not None for s in senders))], dtype=torch.int32)
    if dist.get_world_size() > 1:
        C.blocking("all_reduce", "push status", dist.all_reduce, flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def _agree(problem: str, what: str, group=None) -> None:
    """Every rank's outcome on every rank (``group``: the world's): ``EngineError``
    everywhere, or nothing."""
    every = [problem]
    if dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        C.blocking("all_gather", "push outcome", dist.all_gather_object, every, problem, group=group)
    failed = [(rank, p) for rank, p in enumerate(every) if p]
    if failed:
        where = "" if problem else f" (reported by rank {failed[0][0]})"
        raise EngineError(f"{what}{where}: {'; '.join(p for _, p in failed)}")


def _gather_patches(patches: list[Patch], group, everywhere: bool) -> list[Patch]:
    """Every rank's patches of a unit (in rank order) on rank 0, or on every rank of the group
    when several feed engines; [] elsewhere."""
    world = dist.get_world_size(group)
    if world == 1:
        return patches
    if everywhere:
        got = [None] * world
        C.blocking("all_gather", "push patches", dist.all_gather_object, got, patches, group=group)
    else:
        got = [None] * world if dist.get_rank() == 0 else None
        C.blocking("gather", "push patches", dist.gather_object, patches, got, dst=0, group=group)
    return [p for ps in got for p in ps] if got is not None else []
