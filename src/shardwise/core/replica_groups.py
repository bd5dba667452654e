"""Replica groups outside the job: the seam through which one more reduction of every unit's
gradient shard is plugged in (``shard(fault_tolerance=...)``).

A job (one torchrun launch) shards and reduces as it always does. A ``ReplicaGroups`` stands for
the other jobs that train the same model with the same shards: the rank of shard index r of
every job holds the same rows (with hybrid sharding, a job's replicas hold them alike, so jobs
of different sizes can train together). Once a unit's reduction inside the job is complete
(its reduce-scatter and, with hybrid sharding, the all-reduce across the job's own replicas),
its gradient shard is divided by the job's N ranks and goes to ``all_reduce``, which averages
it in place over the jobs taking part in this step. The core knows nothing else about it:
``shardwise.ft`` builds one on torchft, and a test can build one on plain process groups.

Note [the job's average before the groups']: the job divides by its own N before the groups
average, not after, so that every job ends with the same gradient whatever the jobs' sizes;
dividing after would leave each job with the groups' average divided by its own N, silently
different on jobs of different sizes. Weighting each job's average by its number of ranks
(so that every rank's batch counts once) is the ``ReplicaGroups``' part: ``shardwise.ft``
does it (Note [jobs of different sizes] in ft/replicas.py).
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
        """Average ``tensor`` (this job's average) in place over the groups taking part in this
        step; every rank of every group issues the same calls in the same order. The result is
        read after ``wait()``."""

    def size(self) -> int:
        """The groups taking part in this step (known once ``all_reduce`` was issued)."""
