"""Where a rank stands in torchft's view of its job (Note [jobs of different sizes] in
ft/replicas.py): its rank in its replica group, whether it runs a torchft manager, and how the
job's other hybrid-sharding replicas learn what that manager decided."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core import collectives as C
from ..core import groups


@dataclass(frozen=True)
class Place:
    """This rank's rank in its replica group (its shard index) of ``size``, whether it runs a
    manager (it is in the job's first replica), and with hybrid sharding the job's ranks of its
    shard index (``replicas``), whose first (the first replica's) tells the others what its
    manager decided."""

    rank: int
    size: int
    leads: bool
    replicas: dist.ProcessGroup | None

    @staticmethod
    def of(mesh: groups.Mesh, sharded: bool) -> Place:
        if not sharded:  # no_shard: every rank a replica, rank 0's the first
            whole = mesh.shard if mesh.shard is not None else dist.group.WORLD
            alone = dist.get_world_size(whole) == 1
            return Place(0, 1, dist.get_rank(whole) == 0, None if alone else whole)
        if mesh.replicate is None:
            return Place(dist.get_rank(), dist.get_world_size(), True, None)
        shard, replicas = mesh.shard, mesh.replicate
        return Place(dist.get_rank(shard), dist.get_world_size(shard), dist.get_rank(replicas) == 0, replicas)

    def tell(self, obj):
        """The first replica's ``obj`` on every replica of this shard index (``obj`` itself
        without hybrid sharding)."""
        if self.replicas is None:
            return obj
        return C.broadcast_object(obj, 0, groups.host_group(self.replicas), "torchft outcome")

    def share(self, work, tensor: torch.Tensor):
        """The groups' average (``work``, on the first replica) of ``tensor``, on every replica
        of this shard index once waited for."""
        return work if self.replicas is None else _Shared(work, tensor, self.replicas)


class _Shared:
    def __init__(self, work, tensor: torch.Tensor, replicas: dist.ProcessGroup):
        self.work, self.tensor, self.replicas = work, tensor, replicas

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        # (each shard index broadcasts its own shard's size: the record notes none, so that the
        # step check compares the broadcasts' order, not their sizes, across shard indexes)
        C.broadcast(self.tensor, 0, self.replicas, "torchft average", numel=0).wait()
        return True
