"""How a push reaches the engine's workers: the transports, objects registered by name
(``TRANSPORTS``; ``transport(name)`` gives one). Each knows what the trainer tells vLLM at
the handshake (``trainer_info``), how a push is sent, and, for shardwise's own, both ends of
the link. On CPU:

- ``shm``: shared memory on one machine. Rank 0 owns two staging buffers that alternate (one
  filled while the engine loads the other), files in /dev/shm mapped by both sides; an update
  names the buffer it filled, so nothing is copied in transit. The files are unlinked as soon
  as the engine has mapped them: nothing is left behind when either side dies.
- ``tcp``: trainer rank 0 and every engine worker form a Gloo group through vLLM's
  ``stateless_init_torch_distributed_process_group`` (rank 0 hosts the rendezvous); each
  bucket is broadcast to the workers while the engine's ``update_weights`` call receives it.

and vLLM's own GPU engines, fed by the same source: ``nccl`` (a broadcast group of rank 0 and
the engine's workers) and ``ipc`` (CUDA IPC handles, the engine on this rank's GPUs); full
pushes only, not run here (no GPU).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import ClassVar

import torch
import torch.distributed as dist

from ..core import collectives as C


class Transport:
    """One way a push reaches the engine's workers."""

    name: ClassVar[str]
    remote: ClassVar[bool]  # the engine may run on other machines: rank 0's address, its workers
    delta: ClassVar[bool] = True  # takes delta pushes (changed values only)
    overlaps: ClassVar[bool] = True  # takes a push beside training (push(wait=False))

    def trainer_info(self, *, rank: int, delta: bool, bucket_bytes: int, host: str, port: int,
                     workers: tuple[int, ...], feeders: int, timeout: float):
        """vLLM's ``TrainerInitInfo`` for the backend this transport runs on (``workers``: of
        each engine this rank feeds; ``feeders``: how many ranks feed one)."""
        from .init_info import ShardwiseTrainerInitInfo

        return ShardwiseTrainerInitInfo(rank=rank, transport=self.name, delta=delta, bucket_bytes=bucket_bytes,
                                        host=host, port=port, workers=workers, feeders=feeders, timeout=timeout)

    def client(self, feeds: list):
        """What vLLM's trainer engine takes as its ``client``: shardwise's own, every engine
        this rank feeds (``trainer.Feed``)."""
        return feeds

    def send(self, engine, version: int, client, source, view=None) -> None:
        """One push through vLLM's trainer engine (collective); ``view``: what it reads
        (``source.Live`` or ``Frozen``; None: the units as they are)."""
        engine.send_weights(version=version, view=view)

    def writer(self, info):
        """A feeding trainer rank's end of one engine's link, from its
        ``ShardwiseTrainerInitInfo`` (``workers``: that engine's)."""
        raise NotImplementedError

    def reader(self, info, rank: int):
        """An engine worker's end (``rank``: 1 + the worker's index), from the handshake."""
        raise NotImplementedError


class Shm(Transport):
    name, remote = "shm", False

    def writer(self, info):
        return ShmWriter(info.bucket_bytes)

    def reader(self, info, rank: int):
        return ShmReader(info.paths)


class Tcp(Transport):
    name, remote = "tcp", True

    def writer(self, info):
        return TcpWriter(info.bucket_bytes, info.host, info.port, info.workers, info.timeout)

    def reader(self, info, rank: int):
        return TcpReader(info.host, info.port, rank, info.world_size, info.timeout)


class VllmOwn(Transport):
    """vLLM's own engines: the trainer's source, vLLM's packing and link."""

    delta = overlaps = False

    def client(self, feeds: list):
        """vLLM's: rank 0's one engine's client, None elsewhere."""
        return feeds[0].client if feeds else None

    def send(self, engine, version: int, client, source, view=None) -> None:
        if client is not None:
            client.version = str(version)
        t0 = time.perf_counter()
        engine.send_weights()
        if client is not None:
            nbytes = sum(e.nbytes for e in source.exports)
            C.book_sent("weight_sync", nbytes, nbytes, time.perf_counter() - t0, 0.0)


class Nccl(VllmOwn):
    name, remote = "nccl", True

    def trainer_info(self, *, rank, delta, bucket_bytes, host, port, workers, feeders, timeout):
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        if rank == 0 and not port:
            with socket.socket() as s:
                s.bind((host or "", 0))
                port = s.getsockname()[1]
        return NCCLTrainerInitInfo(
            rank=rank, master_address=host or "127.0.0.1", master_port=port, world_size=1 + sum(workers),
            packed=True, packed_buffer_size_bytes=bucket_bytes,
        )


class Ipc(VllmOwn):
    name, remote = "ipc", False

    def trainer_info(self, *, rank, delta, bucket_bytes, host, port, workers, feeders, timeout):
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(rank=rank, packed=True, packed_buffer_size_bytes=bucket_bytes)


TRANSPORTS: dict[str, Transport] = {t.name: t for t in (Shm(), Tcp(), Nccl(), Ipc())}


def transport(name: str) -> Transport:
    """The transport of a name (the one place names are looked up)."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}: one of {sorted(TRANSPORTS)}")
    return TRANSPORTS[name]


SHM_DIR = "/dev/shm"


class ShmWriter:
    """Trainer side of the shared-memory transport."""

    def __init__(self, bucket_bytes: int):
        half = bucket_bytes // 2
        token = f"shardwise-push-{os.getpid()}-{secrets.token_hex(4)}"
        self.paths = [os.path.join(SHM_DIR, f"{token}-{i}") for i in range(2)]
        self.buffers = []
        for path in self.paths:
            with open(path, "wb") as f:
                f.truncate(half)
            self.buffers.append(torch.from_file(path, shared=True, size=half, dtype=torch.uint8))

    def init_info(self) -> dict:
        return {"transport": "shm", "paths": self.paths}

    def connect(self) -> None:
        """Nothing to join: the engine maps the files in its init call."""

    def connected(self) -> None:
        """The engine has mapped the files: unlink them (the mappings stay)."""
        self._unlink()

    def deliver(self, update: Callable[[], None], index: int, nbytes: int) -> None:
        """The engine's update call reads the buffer where it lies: nothing to move."""
        update()

    def close(self) -> None:
        self._unlink()
        self.buffers = []

    def _unlink(self) -> None:
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


class TcpWriter:
    """Trainer side of the Gloo transport: rank 0 of a group with the engine's workers."""

    def __init__(self, bucket_bytes: int, host: str, port: int, workers: int, timeout: float):
        half = bucket_bytes // 2
        self.buffers = [torch.empty(half, dtype=torch.uint8) for _ in range(2)]
        self.listener = socket.create_server((host, port), backlog=64)
        self.host, self.port = host, self.listener.getsockname()[1]
        self.world = 1 + workers
        self.timeout = timeout
        self.group = None
        self.rpc = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-push-rpc")

    def init_info(self) -> dict:
        return {"transport": "tcp", "host": self.host, "port": self.port, "world_size": self.world}

    def connect(self) -> None:
        """Host the rendezvous and join the group (blocks until every worker has joined: run
        beside the engine's init call)."""
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        listener, self.listener = self.listener, None
        self.group = stateless_init_torch_distributed_process_group(
            self.host, self.port, 0, self.world, "gloo", listen_socket=listener,
            timeout=timedelta(seconds=self.timeout),
        )

    def connected(self) -> None:
        pass

    def deliver(self, update: Callable[[], None], index: int, nbytes: int) -> None:
        """The engine receives inside its update call: make it beside the broadcast."""
        call = self.rpc.submit(update)
        broadcast(self.group, self.buffers[index][:nbytes])
        call.result()

    def close(self) -> None:
        self.rpc.shutdown(wait=False)
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        if self.group is not None:
            _destroy(self.group)
            self.group = None
        self.buffers = []


def broadcast(group, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def _destroy(group) -> None:
    from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

    with contextlib.suppress(Exception):  # a peer already gone: nothing left to release
        stateless_destroy_torch_distributed_process_group(group)


# --- the engine's side
class ShmReader:
    def __init__(self, paths: list[str]):
        self.buffers = [
            torch.from_file(p, shared=True, size=os.path.getsize(p), dtype=torch.uint8) for p in paths
        ]

    def receive(self, bucket: int, nbytes: int) -> torch.Tensor:
        return self.buffers[bucket][:nbytes]

    def close(self) -> None:
        self.buffers = []


class TcpReader:
    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout: float):
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        self.group = stateless_init_torch_distributed_process_group(
            host, port, rank, world_size, "gloo", timeout=timedelta(seconds=timeout)
        )

    def receive(self, bucket: int, nbytes: int) -> torch.Tensor:
        data = torch.empty(nbytes, dtype=torch.uint8)
        broadcast(self.group, data)
        return data

    def close(self) -> None:
        if self.group is not None:
            _destroy(self.group)
            self.group = None
