"""How a push's buckets reach the engine's workers on CPU: shared memory on one machine, a Gloo
link over TCP across machines. The trainer side (rank 0) owns two staging buffers that
alternate (one filled while the engine loads the other); the engine side reads what each
update names.

- ``shm``: the buffers are files in /dev/shm mapped by both sides; an update names the buffer
  it filled, so nothing is copied in transit. The files are unlinked as soon as the engine has
  mapped them: nothing is left behind when either side dies.
- ``tcp``: trainer rank 0 and every engine worker form a Gloo group through vLLM's
  ``stateless_init_torch_distributed_process_group`` (rank 0 hosts the rendezvous); each
  bucket is broadcast to the workers while the engine's ``update_weights`` call receives it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"


class ShmWriter:
    """Trainer side of the shared-memory transport."""

    name = "shm"

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

    def send(self, index: int, nbytes: int) -> None:
        """Nothing to move: the engine reads the buffer where it lies."""

    def close(self) -> None:
        self._unlink()
        self.buffers = []

    def _unlink(self) -> None:
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


class TcpWriter:
    """Trainer side of the Gloo transport: rank 0 of a group with the engine's workers."""

    name = "tcp"

    def __init__(self, bucket_bytes: int, host: str, port: int, workers: int, timeout: float):
        half = bucket_bytes // 2
        self.buffers = [torch.empty(half, dtype=torch.uint8) for _ in range(2)]
        self.listener = socket.create_server((host, port), backlog=64)
        self.host, self.port = host, self.listener.getsockname()[1]
        self.world = 1 + workers
        self.timeout = timeout
        self.group = None

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

    def send(self, index: int, nbytes: int) -> None:
        broadcast(self.group, self.buffers[index][:nbytes])

    def close(self) -> None:
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
