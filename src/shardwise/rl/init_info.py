"""The trainer's settings for the "shardwise" weight-transfer backend, as vLLM's
``TrainerInitInfo`` (what ``WeightTransferTrainerFactory`` dispatches on): its own module so
that the transports build it and the sender reads it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo


@dataclass
class ShardwiseTrainerInitInfo(TrainerInitInfo):
    """The trainer's settings for the "shardwise" backend (``rank``: this trainer rank)."""

    backend: ClassVar[str] = "shardwise"
    transport: str = "shm"  # a shardwise transport's name (transport.TRANSPORTS)
    delta: bool = False
    bucket_bytes: int = 64 << 20  # staging memory per engine fed, two alternating halves
    host: str = ""  # tcp: the address of this rank the engine's workers connect to
    port: int = 0  # tcp: 0 picks a free port (the i-th engine this rank feeds: port + i)
    workers: tuple[int, ...] = (1,)  # tcp: the workers (TP x PP x DP) of each engine this rank feeds
    feeders: int = 1  # how many trainer ranks feed an engine (delta: each gets every change)
    timeout: float = 60.0
