"""``VLLMSync``: after each optimizer step, the trainer's new weights into a running vLLM
engine, through vLLM's weight-transfer API.

    llm = LLM(model=path, weight_transfer_config={"backend": "shardwise"}, ...)   # rank 0
    sync = shardwise.rl.VLLMSync(model, llm if rank == 0 else None)  # or "http://host:8000"
    for step in ...:
        ...; opt.step()
        sync.push()                                   # collective; returns the version
"""

from __future__ import annotations

import socket
import time
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import collectives as C
from ..errors import ShardwiseError
from .clients import EngineError, LLMClient, ServerClient, Watched
from .plugin import register
from .trainer import ShardwiseSource, ShardwiseTrainerInitInfo

TRANSPORTS = ("auto", "shm", "tcp", "nccl", "ipc")


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
        if transport not in TRANSPORTS:
            raise ShardwiseError(f"transport={transport!r}: choose one of {TRANSPORTS}")
        if (dist.get_rank() == 0) != (engine is not None):
            raise ShardwiseError(
                f"rank {dist.get_rank()} passed engine={type(engine).__name__}: rank 0 passes the "
                "vllm.LLM or the server's URL, every other rank None"
            )
        if bucket_bytes < 1 << 16:
            raise ShardwiseError(f"bucket_bytes={bucket_bytes}: give at least 64 KiB")
        if delta and transport in ("nccl", "ipc"):
            raise ShardwiseError("delta=True takes transport 'shm' or 'tcp' (vLLM's nccl and ipc engines send whole tensors)")
        _same_everywhere((str(dtype), bucket_bytes, transport, delta))
        self.model, self.delta = model, delta
        self.bucket_bytes, self.address, self.timeout = bucket_bytes, address, timeout
        self.client = None
        if engine is not None:
            inner = ServerClient(engine, timeout) if isinstance(engine, str) else LLMClient(engine)
            self.client = Watched(inner, timeout)
        self.transport, engine_dtype = self._engine_facts(transport)
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
            if self.transport in ("nccl", "ipc"):
                self._push_vllm(version)
            else:
                self.engine.send_weights(version=version)
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
        rank, transport = dist.get_rank(), self.transport
        if transport in ("shm", "tcp"):
            host, port = self._address(transport)
            workers = [self.client.workers() if rank == 0 and transport == "tcp" else 1]
            return ShardwiseTrainerInitInfo(
                rank=rank, transport=transport, delta=self.delta, bucket_bytes=self.bucket_bytes,
                host=host, port=port, workers=workers[0], timeout=self.timeout,
            )
        return _vllm_init_info(transport, rank, self.client, self._address("tcp"), self.bucket_bytes)

    def _engine_facts(self, transport: str) -> tuple[str, torch.dtype]:
        """Rank 0 asks the engine, every rank learns: the transport "auto" picks, and the
        dtype the engine holds (the default wire dtype)."""
        facts = [None]
        if self.client is not None:
            auto = "shm" if self.client.local else "tcp"
            facts = [(auto if transport == "auto" else transport, str(self.client.dtype()).removeprefix("torch."))]
        if dist.get_world_size() > 1:
            C.blocking("broadcast", "VLLMSync engine facts", dist.broadcast_object_list, facts, src=0)
        return facts[0][0], getattr(torch, facts[0][1])

    def _address(self, transport: str) -> tuple[str, int]:
        if transport != "tcp" or self.client is None:
            return "", 0
        host, _, port = (self.address or "").partition(":")
        if not host:
            host = _route_to(getattr(self.client.client, "url", ""))
        return host, int(port or 0)

    def _push_vllm(self, version: int) -> None:
        """vLLM's own nccl / ipc engine, fed by the same source (not run here: no GPU)."""
        if self.client is not None:
            self.client.version = str(version)
        t0 = time.perf_counter()
        self.engine.send_weights()
        if self.client is not None:
            nbytes = sum(e.nbytes for e in self.source.exports)
            C.book_sent("weight_sync", nbytes, nbytes, time.perf_counter() - t0, 0.0)

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
    host = urlparse(url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _vllm_init_info(transport: str, rank: int, client, address: tuple[str, int], bucket_bytes: int):
    """vLLM's own GPU engines: nccl (a broadcast group of rank 0 and the engine's workers) or
    ipc (CUDA IPC handles, the engine on this rank's GPUs)."""
    if transport == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(rank=rank, packed=True, packed_buffer_size_bytes=bucket_bytes)
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    host, port = address
    workers = client.workers() if client is not None else 1
    if rank == 0 and not port:
        with socket.socket() as s:
            s.bind((host or "", 0))
            port = s.getsockname()[1]
    return NCCLTrainerInitInfo(
        rank=rank, master_address=host or "127.0.0.1", master_port=port, world_size=1 + workers,
        packed=True, packed_buffer_size_bytes=bucket_bytes,
    )
