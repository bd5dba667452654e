"""torchft's HTTP checkpoint transport as a heal uses it: serving at an address other groups
reach, and noting what a heal received (its bytes and seconds: ``Torchft.last_heal``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
from torchft.checkpointing import HTTPTransport


@dataclass(frozen=True)
class Received:
    bytes: int
    seconds: float
    source: str


class Transport(HTTPTransport):
    """torchft's HTTP transport at ``host`` (torchft's names this machine by its hostname,
    which another node or namespace may not resolve); ``received`` and ``failed`` say how the
    last heal went."""

    def __init__(self, host: str, timeout: timedelta):
        self._host = host
        self.received: Received | None = None
        self.failed: Exception | None = None
        super().__init__(timeout=timeout, num_chunks=0)

    def address(self) -> str:
        port = self._server.socket.getsockname()[1]
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{port}/checkpoint/"

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta):
        t0 = time.perf_counter()
        try:
            state = super().recv_checkpoint(src_rank, metadata, step, timeout)
        except Exception as e:
            self.failed = e
            raise
        self.received = Received(tensor_bytes(state), time.perf_counter() - t0, f"{metadata}{step}")
        return state


def tensor_bytes(obj) -> int:
    """Bytes of the distinct storages of the tensors in ``obj`` (a heal's snapshot)."""
    seen: dict[int, int] = {}
    stack = [obj]
    while stack:
        o = stack.pop()
        if torch.is_tensor(o):
            s = o.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif hasattr(o, "__dataclass_fields__"):
            stack.extend(vars(o).values())
    return sum(seen.values())
