"""Launch and process groups: torchrun's environment, the backend, the device of each rank."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist


DEFAULT_TIMEOUT_S = 300.0

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init(*, backend: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Start the default process group from torchrun's environment.

    Picks ``nccl`` when CUDA is available and ``gloo`` otherwise, binds each process to
    ``cuda:LOCAL_RANK``, and sets the collective timeout (seconds) after which a collective
    that cannot complete (a rank died or took another path) raises on every rank instead of
    hanging, naming where each rank was (flight.py). Without torchrun's variables it starts a
    world of size 1. A no-op when a default group already exists.
    """
    global _timeout_s
    if dist.is_initialized():
        return
    _timeout_s = timeout
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


_timeout_s = DEFAULT_TIMEOUT_S


def timeout_s() -> float:
    """The collective timeout ``init()`` set (its default if another call started the group)."""
    return _timeout_s


_host_groups: dict = {}


def host_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A Gloo group over the ranks of ``group`` for small host-side agreements (one per group
    and process; None for one rank). Its own group, so that its collectives never meet the
    data collectives of ``group``, and on the host, so that reading its result never waits
    for a GPU. Collective: every rank of ``group`` calls it in the same order."""
    if dist.get_world_size(group) == 1:
        return None
    key = group if group is not None else dist.group.WORLD
    if key not in _host_groups:
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        _host_groups[key] = dist.new_group(ranks, backend="gloo", use_local_synchronization=ranks is not None)
    return _host_groups[key]


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
