"""Replica groups outside the job: the seam through which one more reduction of every unit's
gradient shard is plugged in (``shard(fault_tolerance=...)``).

A job (one torchrun launch) shards and reduces as it always does. A ``ReplicaGroups`` stands for
the other jobs that train the same model with the same layout, rank for rank: rank r of every
group holds the same rows. Once a unit's reduction inside the job is complete (its
reduce-scatter and, with hybrid sharding, the all-reduce across the job's own replicas), its
summed gradient shard goes to ``all_reduce``, which averages it in place over the groups
taking part in this step; the job's own average (by its N ranks) follows as usual. The core
knows nothing else about it: ``shardwise.ft`` builds one on torchft, and a test can build one on
plain process groups.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn as nn


@runtime_checkable
class Waitable(Protocol):
    def wait(self) -> object: ...


@runtime_checkable
class ReplicaGroups(Protocol):
    """What ``shard(fault_tolerance=...)`` takes."""

    def attach(self, model: nn.Module) -> None:
        """Called once by ``shard()`` with the sharded model, whose state it may need (healing)."""

    def all_reduce(self, tensor: torch.Tensor) -> Waitable:
        """Average ``tensor`` in place over the groups taking part in this step; every rank of
        every group issues the same calls in the same order. The result is read after ``wait()``."""

    def size(self) -> int:
        """The groups taking part in this step (known once ``all_reduce`` was issued)."""
