"""``VLLMSync``: after each optimizer step, the trainer's new weights into a running vLLM
engine, through vLLM's weight-transfer API.

    llm = LLM(model=path, weight_transfer_config={"backend": "shardwise"}, ...)   # rank 0
    sync = shardwise.rl.VLLMSync(model, llm if rank == 0 else None)  # or "http://host:8000"
    for step in ...:
        ...; opt.step()
        sync.push()                                   # collective; returns the version

    handle = sync.push(wait=False)                    # or beside the next step: a PushHandle
    ...; opt.step()                                   # (what travels is the weights at the push)
    handle.wait()                                     # the version the engines now serve
"""

from __future__ import annotations

import contextlib
import os
import threading
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import torch.nn as nn

from ..core import addresses
from ..core import collectives as C
from ..core.errors import ShardwiseError
from ..core.runtime import require_idle
from .clients import EngineError, LLMClient, ServerClient, Watched
from .plugin import register
from .sender import Feed, ShardwiseSource
from .source import Frozen, Live, PushGroups
from .transport import TRANSPORTS, VllmOwn


class VLLMSync:
    """Streams a sharded model's weights into vLLM engines (collective: every rank builds it).

    ``engine``: on rank 0 an in-process ``vllm.LLM``, the URL of a ``vllm serve``, or a list
    of URLs (several engines: data-parallel replicas, other machines); None on the other
    ranks. Every engine must run the "shardwise" weight-transfer backend
    (``weight_transfer_config={"backend": "shardwise"}``), registered in every vLLM process
    by shardwise's plugin. The handshake checks every name and shape against the engine's
    loader before any weight moves. Several engines: engine j is fed by the j-th rank of the
    replica holding rank 0 (modulo its size), from the units that rank gathers anyway, so
    each trainer rank's bytes leave it once per engine it feeds, all engines at once; a push
    commits on every engine or on none.

    - ``dtype``: the wire dtype of floating-point tensors. None (the default): the dtype the
      engine holds, which the handshake asks it for, so the engine gets the trainer's weights
      as exactly as it can hold them (an engine in a dtype shardwise does not send, fp8 say,
      is refused: pass ``dtype`` then). One of fp32, bf16, fp16. A narrower one (bf16 into an
      fp32 engine) halves the bytes and rounds every weight on the way: the engine then
      serves a rounded model (logprobs about 1e-3 off the trainer's, docs/rl.md).
    - ``bucket_bytes``: staging memory per engine on the rank feeding it, two halves that
      alternate (one filled while the engine loads the other).
    - ``transport``: "shm" (shared memory, one machine), "tcp" (Gloo, the engine on other
      machines; ``address`` = this rank's host as the engine's workers reach it, optionally
      ":port"), "auto" (shm for an in-process ``LLM`` or local URLs, else tcp), or vLLM's own
      GPU engines "nccl" / "ipc" (one engine, full pushes only; not run here: no GPU).
    - ``delta``: after the first push, send only the values that changed (bitwise, in
      ``dtype``); each rank keeps a copy of its own rows, each engine a copy of the checkpoint.
    - ``timeout``: seconds one engine call may take; a dead engine is noticed within seconds.
    """

    def __init__(
        self,
        model: nn.Module,
        engine,
        *,
        dtype: torch.dtype | None = None,
        bucket_bytes: int = 64 << 20,
        transport: str = "auto",
        delta: bool = False,
        address: str | None = None,
        timeout: float = 300.0,
    ):
        if not dist.is_initialized():
            raise ShardwiseError("VLLMSync is collective: call shardwise.init() and shard() first")
        _agree_on_arguments(_argument_problem(engine, transport, bucket_bytes, delta), (str(dtype), bucket_bytes, transport, delta))
        self.model, self.delta = model, delta
        self.bucket_bytes, self.address, self.timeout = bucket_bytes, address, timeout
        name, engine_dtype, asked = self._engine_facts(engine, transport, dtype)
        self.transport = TRANSPORTS[name]
        self.dtype = wire_dtype(dtype, engine_dtype)
        self.source = ShardwiseSource(model, self.dtype)
        self.feeds, self.feeders = self._feeds(asked)
        self.version = 0  # of the last push that completed
        self.engine = None
        self._pending: PushHandle | None = None
        self._groups: PushGroups | None = None  # a push beside training talks over these
        self._connect()

    def push(self, *, wait: bool = True) -> int | PushHandle:
        """Send the model's current weights (delta mode: what changed since the last push) to
        every engine; collective, between steps. Returns the version the engines now serve.
        Raises ``EngineError`` on every rank when an engine failed; the next push starts over.

        ``wait=False``: return a ``PushHandle`` at once and stream the weights on a thread
        while training goes on (shm and tcp). What travels is the weights as they are now:
        each rank copies its own rows to host memory first (its shard of the model in the
        wire dtype, held until the push ends), so the optimizer may step meanwhile; the thread
        talks over Gloo groups of its own, never interleaved with training's. The engines
        take the update as any push (a server pauses from the first bucket to the commit;
        all engines commit or none). ``handle.wait()`` returns the version or raises the
        push's ``EngineError``; an error nobody waited for is raised by the next push or
        ``close()``. An in-process ``vllm.LLM`` is driven from that thread: call ``wait()``
        before generating with it."""
        self._finish_pending()
        if self.engine is None:
            self._connect()
        version = self.version + 1
        if wait:
            self._send(version, None)
            return version
        if not self.transport.overlaps:
            raise ShardwiseError(f"push(wait=False) takes transport 'shm' or 'tcp' ({self.transport.name!r} "
                                 "pushes between steps): push() instead")
        require_idle(self.source.rt, "VLLMSync.push")
        if self._groups is None:  # collective, on every rank's main thread alike
            self._groups = PushGroups.create(self.source.rt)
        view = Frozen(self.source.rt, self.source.groups, self._groups)
        self._pending = PushHandle(version, lambda: self._send(version, view))
        return self._pending

    def _send(self, version: int, view: Live | None) -> None:
        try:
            self.transport.send(self.engine, version, self.feeds[0].client if self.feeds else None, self.source, view)
        except EngineError:
            self._drop()
            raise
        self.version = version

    def _finish_pending(self) -> None:
        """Wait for a push under way; raise its error unless its handle's ``wait()`` did."""
        handle, self._pending = self._pending, None
        if handle is not None:
            handle.join()
            if handle.error is not None and not handle.reported:
                handle.reported = True
                raise handle.error

    @property
    def pause_seconds(self) -> float:
        """How long the engines this rank feeds stopped serving in the last push (from
        ``start_weight_update`` to the end of ``finish_weight_update``, the longest); 0 on a
        rank that feeds none, and for vLLM's own transports (they do not say)."""
        return getattr(self.engine, "pause_seconds", 0.0)

    def close(self) -> None:
        """Wait for a push under way, then release the staging buffers and the links (the
        engines keep serving)."""
        try:
            self._finish_pending()
        finally:
            self._drop()

    def _connect(self) -> None:
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        register()  # vLLM loads its plugins only where an engine starts: not on other ranks
        info = self._init_info()
        self.engine = WeightTransferTrainerFactory.trainer_init(
            info, client=self.transport.client(self.feeds), source=self.source
        )

    def _init_info(self):
        remote = self.transport.remote
        host, port = self._address() if remote else ("", 0)
        workers = tuple(f.client.workers() if remote else 1 for f in self.feeds)
        return self.transport.trainer_info(rank=dist.get_rank(), delta=self.delta, bucket_bytes=self.bucket_bytes,
                                           host=host, port=port, workers=workers, feeders=self.feeders,
                                           timeout=self.timeout)

    def _client(self, engine) -> Watched:
        inner = ServerClient(engine, self.timeout) if isinstance(engine, str) else LLMClient(engine)
        return Watched(inner, self.timeout)

    def _engine_facts(self, engine, transport: str, dtype: torch.dtype | None) -> tuple[str, str, list[Watched]]:
        """Rank 0 checks the engines and asks each for its dtype; every rank learns the
        transport "auto" picks, the dtype the engines hold (the default wire dtype) and the
        engines' URLs (several engines), or the problem. Rank 0 also gets the clients."""
        facts, asked = [None], []
        if dist.get_rank() == 0:
            facts = [self._ask(engine, transport, dtype, asked)]
        if dist.get_world_size() > 1:
            C.blocking("broadcast", "VLLMSync engine facts", dist.broadcast_object_list, facts, src=0)
        name, dtype, self.urls, problem = facts[0]
        if problem:
            where = "" if dist.get_rank() == 0 else " (reported by rank 0)"
            kind, message = problem
            raise (EngineError if kind == "engine" else ShardwiseError)(message.replace("{where}", where, 1))
        return name, dtype, asked

    def _ask(self, engine, transport: str, dtype: torch.dtype | None, asked: list[Watched]) -> tuple:
        engines = list(engine) if isinstance(engine, (list, tuple)) else [engine]
        several = len(engines) > 1
        if not engines:
            return "", "", [], ("usage", "engine=[]{where}: give rank 0 at least one engine")
        if several and not all(isinstance(e, str) for e in engines):
            return "", "", [], ("usage", "several engines{where} are given by their URLs (`vllm serve`): an "
                                "in-process vllm.LLM can only be the one engine (no other rank reaches it)")
        if several and transport != "auto" and isinstance(TRANSPORTS[transport], VllmOwn):
            return "", "", [], ("usage", f"several engines{{where}} take transport 'shm' or 'tcp' ({transport!r} "
                                "feeds one engine)")
        dtypes = []
        for e in engines:
            try:
                asked.append(self._client(e))
                dtypes.append(str(asked[-1].dtype()).removeprefix("torch."))
            except EngineError as err:  # every rank learns of it: none waits on the broadcast
                which = f" at {e}" if several else ""
                return "", "", [], ("engine", f"the engine{which} could not be asked for its dtype{{where}}: {err}")
        if len(set(dtypes)) > 1 and dtype is None:
            return "", "", [], ("usage", f"the engines hold different dtypes {dtypes}{{where}}: serve them in one, "
                                "or pass the wire dtype explicitly (dtype=torch.bfloat16)")
        auto = "shm" if all(c.local for c in asked) else "tcp"
        urls = engines if several else []
        return auto if transport == "auto" else transport, dtypes[0], urls, ""

    def _feeds(self, asked: list[Watched]) -> tuple[list[Feed], int]:
        """The engines this rank feeds and how many ranks feed one: rank 0 the only engine;
        several, engine j the j-th rank (modulo) of the replica holding rank 0."""
        if not self.urls:
            return ([Feed(asked[0])] if asked else []), 1
        every = [None] * dist.get_world_size()
        reads = self.source.rt.mesh.in_first_shard_group()
        C.blocking("all_gather", "VLLMSync feeders", dist.all_gather_object, every, reads)
        ranks = [r for r, first in enumerate(every) if first]
        feeds = []
        for j, url in enumerate(self.urls):
            if ranks[j % len(ranks)] == dist.get_rank():
                client = asked[j] if asked else self._client(url)
                feeds.append(Feed(client, label=f"engine {j} ({url}): "))
        return feeds, min(len(ranks), len(self.urls))

    def _address(self) -> tuple[str, int]:
        """Where the engines' workers reach this rank (``address``, or this machine's address
        on the route to the first engine's URL); port 0: any free one."""
        if not self.feeds:
            return "", 0
        host, _, port = (self.address or "").partition(":")
        if not host:
            host = _route_to(getattr(self.feeds[0].client.client, "url", ""))
        return host, int(port or 0)

    def _drop(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


class PushHandle:
    """A push streaming beside training (``VLLMSync.push(wait=False)``)."""

    def __init__(self, version: int, work):
        self.version = version
        self.error: BaseException | None = None
        self.reported = False
        self._thread = threading.Thread(target=self._run, args=(work,), name=f"shardwise-push:v{version}")
        self._thread.start()

    def done(self) -> bool:
        """Whether the push has ended (committed or failed)."""
        return not self._thread.is_alive()

    def wait(self) -> int:
        """Block until the engines serve this push's weights and return its version; raise its
        ``EngineError`` (on every rank alike) when it failed."""
        self.join()
        if self.error is not None:
            self.reported = True
            raise self.error
        return self.version

    def join(self) -> None:
        self._thread.join()

    def _run(self, work) -> None:
        # the lowest CPU priority for this thread and those it starts (Linux: per thread), so
        # that where the push and the training step share cores the step goes first
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            work()
        except BaseException as e:  # kept for wait(): a thread has nobody else to tell
            self.error = e


WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what a push sends floating-point tensors in


def wire_dtype(requested: torch.dtype | None, engine: str) -> torch.dtype:
    """The dtype floating-point tensors travel in: ``requested``, else the one the engine
    holds (``engine``: its name as the engine reports it, "bfloat16")."""
    if requested is not None:
        if requested not in WIRE_DTYPES:
            raise ShardwiseError(f"dtype={requested}: a push sends floating-point weights in one of "
                                 f"{[str(d) for d in WIRE_DTYPES]}")
        return requested
    dtype = getattr(torch, engine, None)
    if dtype not in WIRE_DTYPES:
        raise ShardwiseError(
            f"the engine holds its weights in {engine!r}, which shardwise does not send: pass the wire "
            f"dtype explicitly, VLLMSync(..., dtype=torch.bfloat16) (one of {[str(d) for d in WIRE_DTYPES]})"
        )
    return dtype


def _argument_problem(engine, transport: str, bucket_bytes: int, delta: bool) -> str:
    """What is wrong with this rank's arguments ("" when nothing)."""
    if transport != "auto" and transport not in TRANSPORTS:
        return f"transport={transport!r}: choose 'auto' or one of {sorted(TRANSPORTS)}"
    if (dist.get_rank() == 0) != (engine is not None):
        return (
            f"rank {dist.get_rank()} passed engine={type(engine).__name__}: rank 0 passes the "
            "vllm.LLM, the server's URL or a list of URLs, every other rank None"
        )
    if bucket_bytes < 1 << 16:
        return f"bucket_bytes={bucket_bytes}: give at least 64 KiB"
    if delta and transport != "auto" and not TRANSPORTS[transport].delta:
        takes = sorted(n for n, t in TRANSPORTS.items() if t.delta)
        return f"delta=True takes transport {takes} ({transport!r} sends whole tensors)"
    return ""


def _agree_on_arguments(problem: str, settings: tuple) -> None:
    """Every rank's argument problem and settings on every rank, so that a mistake on one rank
    raises on all of them instead of leaving the others in the handshake's collectives."""
    every = [(problem, settings)]
    if dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        C.blocking("all_gather", "VLLMSync arguments", dist.all_gather_object, every, (problem, settings))
    problems = [p for p, _ in every if p]
    if problems:
        raise ShardwiseError(problems[0])
    if any(s != every[0][1] for _, s in every):
        raise ShardwiseError(f"VLLMSync was built with different settings on different ranks: {[s for _, s in every]}")


def _route_to(url: str) -> str:
    """This machine's address on the route to ``url``'s host (no packet is sent)."""
    try:
        return addresses.route_to(urlparse(url).hostname or "127.0.0.1")
    except OSError:
        return "127.0.0.1"
