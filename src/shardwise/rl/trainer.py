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
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
)

from .. import collectives as C
from ..checkpoint.state import idle_world_runtime
from ..runtime import require_idle
from . import wire
from .clients import EngineError
from .delta import Patch, Shadow
from .source import Export, Gathered, Scratch, by_unit, exports, local_rows, readers
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
        if not self.rt.mesh.first_replica():
            return
        scratch = Scratch()
        with readers(self.rt), torch.no_grad():
            for unit, exps in self.groups:
                gathered = Gathered(self.rt.units[unit], exps, scratch) if unit is not None else None
                for e in exps:
                    out = torch.empty(e.numel, dtype=e.dtype, device=self.rt.device)
                    segments = gathered.segments(e) if gathered else [(0, e.buffer.detach().view(-1))]
                    for start, seg in segments:
                        out[start : start + seg.numel()].copy_(seg)
                    yield e.name, out.view(e.shape)


@dataclass
class ShardwiseTrainerInitInfo(TrainerInitInfo):
    """The trainer's settings for the "shardwise" backend (``rank``: this trainer rank)."""

    backend: ClassVar[str] = "shardwise"
    transport: str = "shm"  # a shardwise transport's name (transport.TRANSPORTS)
    delta: bool = False
    bucket_bytes: int = 64 << 20  # staging memory on rank 0, two alternating halves
    host: str = ""  # tcp: the address of rank 0 the engine's workers connect to
    port: int = 0  # tcp: 0 picks a free port
    workers: int = 1  # tcp: the engine's workers (TP x PP x DP)
    timeout: float = 60.0


class ShardwiseTrainerWeightTransferEngine(TrainerWeightTransferEngine[ShardwiseTrainerInitInfo]):
    init_info_cls = ShardwiseTrainerInitInfo

    def __init__(self, *, client, source: ShardwiseSource, is_sender: bool, info: ShardwiseTrainerInitInfo):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info
        self.shadow = Shadow()
        self.index = {e.name: i for i, e in enumerate(source.exports)}  # the shadow's keys
        self.writer = None
        self.scratch = Scratch()  # every rank's gathers, on CPU; kept until shutdown

    @classmethod
    def trainer_init(cls, init_info: ShardwiseTrainerInitInfo, *, client, source=None):
        if not isinstance(source, ShardwiseSource):
            raise ValueError("the shardwise backend takes a ShardwiseSource (a sharded model)")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
        problem = ""
        if engine.is_sender:
            try:
                engine._handshake()
            except Exception as e:
                engine.shutdown()
                problem = str(e) if isinstance(e, EngineError) else f"{type(e).__name__}: {e}"
        _agree(problem, "the engine refused the handshake")
        return engine

    def _handshake(self) -> None:
        info = self.info
        self.writer = transport(info.transport).writer(info)
        declared = [[e.name, wire.dtype_name(e.dtype), list(e.shape)] for e in self.source.exports]
        payload = {**self.writer.init_info(), "tensors": declared, "delta": info.delta, "timeout": info.timeout}
        # tcp: both sides join the group at once. The engine checks the names first and
        # joins only if they fit; a refused handshake leaves the joining thread to time out.
        joined: Future = Future()
        threading.Thread(target=_run_into, args=(self.writer.connect, joined), daemon=True).start()
        self.client.init_weight_transfer_engine(payload)
        joined.result(timeout=info.timeout)
        self.writer.connected()

    def send_weights(self, version: int = 0) -> None:
        """Push every weight (full) or what changed (delta, after a full push); collective."""
        src, rt = self.source, self.source.rt
        require_idle(rt, "VLLMSync.push")
        delta = self.info.delta and self.shadow.valid
        payload = sum(e.nbytes for e in src.exports)
        sender = _Sender(self.client, self.writer, version, payload, self.info.delta) if self.is_sender else None
        reads = rt.mesh.first_replica()
        problem = ""
        try:
            with readers(rt), torch.no_grad():
                if sender:
                    sender.guard(sender.start)
                for unit, exps in src.groups:
                    if _agree_flag(sender):
                        break
                    if not reads:
                        continue
                    if delta:
                        self._delta_unit(unit, exps, sender)
                    else:
                        self._full_unit(unit, exps, sender)
                if sender:
                    sender.guard(sender.finish)
        finally:
            if sender:
                problem = sender.close()
        if self.info.delta:
            self.shadow.valid = not problem  # a failed push leaves the engine's copy unknown
            if problem:
                self.shadow.reset()
        _agree(problem, f"push of version {version} failed")

    def _full_unit(self, unit: int | None, exps: list[Export], sender) -> None:
        gathered = Gathered(self.source.rt.units[unit], exps, self.scratch) if unit is not None else None
        for e in exps:
            if sender:
                segments = gathered.segments(e) if gathered else [(0, e.buffer.detach().view(-1))]
                sender.guard(sender.packer.dense, e.name, e.dtype, e.shape, segments)
            if self.info.delta:
                rows = local_rows(self.source.rt, e, gathered)
                if rows is not None:
                    self.shadow.store(self.index[e.name], rows[1], e.dtype)

    def _delta_unit(self, unit: int | None, exps: list[Export], sender) -> None:
        rt = self.source.rt
        gathered = None
        if unit is not None and any(e.lora is not None for e in exps):
            gathered = Gathered(rt.units[unit], exps, self.scratch)
        mine = []
        for e in exps:
            rows = local_rows(rt, e, gathered)
            if rows is not None:
                mine += self.shadow.patch(self.index[e.name], rows[0], rows[1], e.dtype)
        group = rt.units[unit].group if unit is not None else rt.mesh.shard
        patches = _gather_to_rank0(mine, group)
        if sender:
            for p in patches:
                e = self.source.exports[p.export]
                if p.indices is None:
                    sender.guard(sender.packer.dense, e.name, e.dtype, e.shape, [(p.first, p.values)])
                else:
                    sender.guard(sender.packer.sparse, e.name, e.dtype, e.shape, p.indices, p.values, p.steps)

    def shutdown(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        self.shadow.reset()
        self.scratch = Scratch()


class _Sender:
    """Rank 0's half of a push: packs buckets and ships each on a thread (the engine's
    ``update_weights`` call, and the transfer itself over tcp) while the next one fills.
    A failure anywhere is kept in ``error``; later steps are skipped and every rank learns
    of it at the next unit."""

    def __init__(self, client, writer, version: int, payload: int, delta: bool):
        self.client, self.writer, self.version, self.payload = client, writer, version, payload
        self.delta = delta
        self.error: BaseException | None = None
        self.free: queue.Queue = queue.Queue()
        for i in range(len(writer.buffers)):
            self.free.put(i)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-push")
        self.packer = wire.Packer(self.acquire, self.ship)
        self.sent = 0
        self.waited = 0.0  # rank 0 blocked on the engine: a bucket to come back, the finish
        self.started = False
        self.t0 = time.perf_counter()

    def guard(self, fn, *args) -> None:
        if self.error is not None:
            return
        try:
            fn(*args)
        except BaseException as e:  # kept for every rank to learn of at the next unit
            self.error = e

    def start(self) -> None:
        self.client.start_weight_update()
        self.started = True

    def finish(self) -> None:
        self.packer.flush()
        t0 = time.perf_counter()
        self.pool.shutdown(wait=True)
        if self.error is None:
            self.client.finish_weight_update(str(self.version))
        self.waited += time.perf_counter() - t0

    def acquire(self) -> wire.Bucket:
        t0 = time.perf_counter()
        while True:
            if self.error is not None:
                raise self.error
            try:
                i = self.free.get(timeout=0.2)
            except queue.Empty:
                continue
            self.waited += time.perf_counter() - t0
            return wire.Bucket(self.writer.buffers[i], i)

    def ship(self, bucket: wire.Bucket) -> None:
        self.pool.submit(self._ship, bucket)

    def _ship(self, bucket: wire.Bucket) -> None:
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
        """End the push on rank 0; "" or what went wrong. A push that failed with the engine
        still alive is aborted: delta mode keeps serving the previous version; full mode has
        replaced some layers, so a server stays paused until the next push completes."""
        self.pool.shutdown(wait=self.error is None)
        e = self.error
        if e is None:
            C.book_sent("weight_sync", self.sent, self.payload, time.perf_counter() - self.t0, self.waited)
            return ""
        problem = str(e) if isinstance(e, EngineError) else f"{type(e).__name__}: {e}"
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


def _run_into(fn, future: Future) -> None:
    try:
        future.set_result(fn())
    except BaseException as e:  # handed to the waiting caller
        future.set_exception(e)


def _agree_flag(sender: _Sender | None) -> bool:
    """Every rank learns whether rank 0's sender has failed (one small broadcast)."""
    flag = torch.tensor([0 if sender is None or sender.error is None else 1], dtype=torch.int32)
    if dist.get_world_size() > 1:
        C.blocking("broadcast", "push status", dist.broadcast, flag, src=0)
    return bool(flag.item())


def _agree(problem: str, what: str) -> None:
    """Rank 0's outcome on every rank: ``EngineError`` everywhere, or nothing."""
    C.agree(problem, "push outcome", lambda m: EngineError(f"{what}: {m}"))


def _gather_to_rank0(patches: list[Patch], group) -> list[Patch]:
    """Every rank's patches of a unit, on rank 0 (in rank order); [] elsewhere."""
    world = dist.get_world_size(group)
    if world == 1:
        return patches
    got = [None] * world if dist.get_rank() == 0 else None
    C.blocking("gather", "push patches", dist.gather_object, patches, got, dst=0, group=group)
    return [p for ps in got for p in ps] if got is not None else []
