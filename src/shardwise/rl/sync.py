"""``VLLMSync``: after each optimizer step, the trainer's new weights into a running vLLM
engine, through vLLM's weight-transfer API.

    llm = LLM(model=path, weight_transfer_config={"backend": "shardwise"}, ...)   # rank 0
    sync = shardwise.rl.VLLMSync(model, llm if rank == 0 else None)  # or "http://host:8000"
    for step in ...:
        ...; opt.step()
        sync.push()                                   # collective; returns the version
"""

from __future__ import annotations

from urllib.parse import urlparse

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import addresses
from .. import collectives as C
from ..errors import ShardwiseError
from .clients import EngineError, LLMClient, ServerClient, Watched
from .plugin import register
from .trainer import ShardwiseSource
from .transport import TRANSPORTS


class VLLMSync:
    """Streams a sharded model's weights into a vLLM engine (collective: every rank builds it).

    ``engine``: on rank 0 an in-process ``vllm.LLM`` or the URL of a ``vllm serve``; None on
    the other ranks. Both must run the "shardwise" weight-transfer backend
    (``weight_transfer_config={"backend": "shardwise"}``), registered in every vLLM process
    by shardwise's plugin. The handshake checks every name and shape against the engine's
    loader before any weight moves.

    - ``dtype``: the wire dtype of floating-point tensors. None (the default): the dtype the
      engine holds, which the handshake asks it for, so the engine gets the trainer's weights
      as exactly as it can hold them. A narrower one (bf16 into an fp32 engine) halves the
      bytes and rounds every weight on the way: the engine then serves a rounded model
      (logprobs about 1e-3 off the trainer's, docs/rl.md).
    - ``bucket_bytes``: staging memory on rank 0, two halves that alternate (one filled while
      the engine loads the other).
    - ``transport``: "shm" (shared memory, one machine), "tcp" (Gloo, the engine on other
      machines; ``address`` = rank 0's host as the engine's workers reach it, optionally
      ":port"), "auto" (shm for an in-process ``LLM`` or a local URL, else tcp), or vLLM's own
      GPU engines "nccl" / "ipc" (full pushes only; not run here: no GPU).
    - ``delta``: after the first push, send only the values that changed (bitwise, in
      ``dtype``); each rank keeps a copy of its own rows, the engine a copy of the checkpoint.
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
        if transport != "auto" and transport not in TRANSPORTS:
            raise ShardwiseError(f"transport={transport!r}: choose 'auto' or one of {sorted(TRANSPORTS)}")
        if (dist.get_rank() == 0) != (engine is not None):
            raise ShardwiseError(
                f"rank {dist.get_rank()} passed engine={type(engine).__name__}: rank 0 passes the "
                "vllm.LLM or the server's URL, every other rank None"
            )
        if bucket_bytes < 1 << 16:
            raise ShardwiseError(f"bucket_bytes={bucket_bytes}: give at least 64 KiB")
        if delta and transport != "auto" and not TRANSPORTS[transport].delta:
            takes = sorted(n for n, t in TRANSPORTS.items() if t.delta)
            raise ShardwiseError(f"delta=True takes transport {takes} ({transport!r} sends whole tensors)")
        _same_everywhere((str(dtype), bucket_bytes, transport, delta))
        self.model, self.delta = model, delta
        self.bucket_bytes, self.address, self.timeout = bucket_bytes, address, timeout
        self.client = None
        if engine is not None:
            inner = ServerClient(engine, timeout) if isinstance(engine, str) else LLMClient(engine)
            self.client = Watched(inner, timeout)
        name, engine_dtype = self._engine_facts(transport)
        self.transport = TRANSPORTS[name]
        self.dtype = dtype if dtype is not None else engine_dtype
        self.source = ShardwiseSource(model, self.dtype)
        self.version = 0  # of the last push that completed
        self.engine = None
        self._connect()

    def push(self) -> int:
        """Send the model's current weights (delta mode: what changed since the last push);
        collective, between steps. Returns the version the engine now serves. Raises
        ``EngineError`` on every rank when the engine failed; the next push starts over."""
        if self.engine is None:
            self._connect()
        version = self.version + 1
        try:
            self.transport.send(self.engine, version, self.client, self.source)
        except EngineError:
            self._drop()
            raise
        self.version = version
        return version

    def close(self) -> None:
        """Release the staging buffers and the link (the engine keeps serving)."""
        self._drop()

    def _connect(self) -> None:
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        register()  # vLLM loads its plugins only where an engine starts: not on other ranks
        info = self._init_info()
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=self.source)

    def _init_info(self):
        rank, remote = dist.get_rank(), self.transport.remote
        host, port = self._address() if remote else ("", 0)
        workers = self.client.workers() if rank == 0 and remote else 1
        return self.transport.trainer_info(rank=rank, delta=self.delta, bucket_bytes=self.bucket_bytes, host=host,
                                           port=port, workers=workers, timeout=self.timeout)

    def _engine_facts(self, transport: str) -> tuple[str, torch.dtype]:
        """Rank 0 asks the engine, every rank learns: the transport "auto" picks, and the
        dtype the engine holds (the default wire dtype)."""
        facts = [None]
        if self.client is not None:
            auto = "shm" if self.client.local else "tcp"
            try:
                facts = [(auto if transport == "auto" else transport, str(self.client.dtype()).removeprefix("torch."))]
            except EngineError as e:  # every rank learns of it: none waits on the broadcast
                facts = [("", str(e))]
        if dist.get_world_size() > 1:
            C.blocking("broadcast", "VLLMSync engine facts", dist.broadcast_object_list, facts, src=0)
        name, dtype = facts[0]
        if not name:
            where = "" if dist.get_rank() == 0 else " (reported by rank 0)"
            raise EngineError(f"the engine could not be asked for its dtype{where}: {dtype}")
        return name, getattr(torch, dtype)

    def _address(self) -> tuple[str, int]:
        """Where the engine's workers reach rank 0 (``address``, or this machine's address on
        the route to the engine's URL); port 0: any free one."""
        if self.client is None:
            return "", 0
        host, _, port = (self.address or "").partition(":")
        if not host:
            host = _route_to(getattr(self.client.client, "url", ""))
        return host, int(port or 0)

    def _drop(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def _same_everywhere(settings: tuple) -> None:
    if dist.get_world_size() == 1:
        return
    every = [None] * dist.get_world_size()
    C.blocking("all_gather", "VLLMSync settings", dist.all_gather_object, every, settings)
    if any(s != every[0] for s in every):
        raise ShardwiseError(f"VLLMSync was built with different settings on different ranks: {every}")


def _route_to(url: str) -> str:
    """This machine's address on the route to ``url``'s host (no packet is sent)."""
    try:
        return addresses.route_to(urlparse(url).hostname or "127.0.0.1")
    except OSError:
        return "127.0.0.1"
