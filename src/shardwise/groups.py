"""Launch and process groups: torchrun's environment, the backend, the device of each rank."""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from . import collectives

DEFAULT_TIMEOUT_S = 300.0

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init(
    *, backend: str | None = None, timeout: float = DEFAULT_TIMEOUT_S, check_collectives: bool = False
) -> None:
    """Start the default process group from torchrun's environment.

    Picks ``nccl`` when CUDA is available and ``gloo`` otherwise, binds each process to
    ``cuda:LOCAL_RANK``, and sets the collective timeout (seconds) after which a collective
    that cannot complete (a rank died or took another path) raises on every rank instead of
    hanging. Without torchrun's variables it starts a world of size 1. A no-op when a default
    group already exists, except that ``check_collectives`` (debug mode: ranks compare every
    collective before issuing it, so one that took another path is named at once) is applied.
    """
    if dist.is_initialized():
        collectives.check_collectives(check_collectives)
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    pg_timeout = timedelta(seconds=timeout)
    if all(v in os.environ for v in _TORCHRUN_VARS):
        dist.init_process_group(backend, timeout=pg_timeout)
    else:
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=pg_timeout
        )
    collectives.check_collectives(check_collectives)


@contextlib.contextmanager
def fake_world(world_size: int, backend: str) -> Iterator[None]:
    """A world of ``world_size`` ranks inside this process, which is rank 0, over torch's
    "fake" process group (nothing is sent; torchtitan estimates memory the same way): the
    planner runs the real runtime in it on fake tensors. Its collectives take ``backend``'s
    paths and count apart from this process's ``comm_stats`` (Note [fake world] in
    collectives.py). It is the default group, so the process must have none yet."""
    if dist.is_initialized():
        raise RuntimeError("a fake world needs a process without a default process group")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        with collectives.standing_in(backend):
            yield
    finally:
        dist.destroy_process_group()


def device() -> torch.device:
    """The device this rank computes on: its local GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size (requires an initialised group)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "no process group: call shardwise.init() (or torch.distributed.init_process_group) "
            "before shardwise.shard()"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def launch_local(nproc: int, entry: Callable, *args) -> dict[int, object]:
    """Run ``entry(*args)`` in ``nproc`` local ranks through torch's elastic launcher (the
    engine behind torchrun), rendezvous on a free loopback port; returns each rank's result."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"shardwise-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{port}",
        max_restarts=0,
        monitor_interval=0.5,
    )
    return elastic_launch(config, entry)(*args)
