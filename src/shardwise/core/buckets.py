"""A bucket of units: consecutive small sharded units that share one all-gather and one
reduce-scatter (DESIGN.md, "A bucket of units"; DDP's gradient buckets for FSDP).

With many small units a step is mostly per-collective latency (Gloo's small collective costs
hundreds of microseconds). So the runtime groups units that run one after another, have the
same settings and are small, into buckets of at most ``BUCKET_BYTES`` gathered bytes, from the
order it recorded on the last step (``plan``); it decides again whenever that order changes.
The first step, which has no order yet, runs every unit alone.

A bucket changes only which collective carries a unit's bytes. Each unit keeps its flat shard
(the optimizer's parameters, its checkpoints), its full buffer, its state and its events; a
gather sends the members' flat shards one after another and each member copies its own part
out when it is waited for; a reduction lays each member's gradient rows side by side and issues
one reduce-scatter once every trainable member has packed its own. The arithmetic is the same
as each unit's own collectives (a reduce-scatter sums element by element), so results are
bitwise those of unbucketed units. Memory stays bounded by the bucket: its gathered rows are
held until its last member copies its part out, and the prefetch limit (``max_unsharded``)
counts the bucket as one unit (``Bucket.occupancy``: the runtime's ``Occupancy`` sees one
gather).

Only units on a Gloo group of several ranks, without codecs, replica groups outside the job
or whole-parameter placement are bucketed: the paths where the shared collective is the one a
unit would issue itself, as rows (Note [Gloo gather and reduce-scatter]). Offloaded units (on
Gloo the shards are in the one memory, no side streams) are bucketed with each other: the
gather's copy of their shards is the copy each would make, and each brings its gradient shard
to its master copy as it would alone. With hybrid sharding the bucket's reduced shard is
all-reduced across the replicas in one collective too, issued as its first member moves its
reduction on. With two replicas each element's sum is the same two numbers, as unbucketed;
with three or more, Gloo's ring adds an element's values in an order set by where it falls in
the ring's chunks, so the last bit may differ from unbucketed units' (every rank still gets the
same sum). On NCCL a small collective costs tens of microseconds, not hundreds, and its units
keep their own (the planner, standing for NCCL, follows).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from . import collectives as C
from . import events
from .unit import Occupancy, ShardedUnit, UnitState

BUCKET_BYTES = 4 << 20  # at most this many gathered bytes per bucket (and per unit bucketed)


def key(unit: ShardedUnit) -> tuple | None:
    """What units must share to share a bucket; None where a unit is never bucketed."""
    if (
        unit.is_root or not C.on_gloo(unit.group) or unit.streams is not None
        or unit.replica_groups is not None or not unit.layout.uniform
        or unit.gather_codec is not None or unit.reduce_codec is not None or unit.replicate_codec is not None
    ):
        return None
    return (
        unit.group, unit.replicate, unit.device, unit.flat_shard.dtype, unit.compute_dtype, unit.reduce_dtype,
        unit.reshard_after_forward, unit.offloaded,
    )


def gathered_bytes(unit: ShardedUnit) -> int:
    """Bytes of a unit's gathered parameters (its full buffer)."""
    return unit.layout.unsharded_numel * unit.compute_dtype.itemsize


def plan(order: Sequence[ShardedUnit], cap: int) -> list[list[ShardedUnit]]:
    """Runs of units consecutive in ``order`` with one key, each unit and each run at most
    ``cap`` gathered bytes; runs of one are left out (they stay alone)."""
    runs: list[list[ShardedUnit]] = []
    run: list[ShardedUnit] = []
    run_key, run_bytes = None, 0
    for u in order:
        k, size = key(u), gathered_bytes(u)
        if run and (k != run_key or run_bytes + size > cap):
            runs.append(run)
            run = []
        if k is None or size > cap:
            continue
        if not run:
            run_key, run_bytes = k, 0
        run.append(u)
        run_bytes += size
    runs.append(run)
    return [r for r in runs if len(r) > 1]


def _channel(units: Sequence[ShardedUnit]) -> int:
    """A bucket's channel (Note [tagged Gloo messages]), made from its members' channels, above
    any unit's: ranks that bucketed differently never pair their messages."""
    return (1 << 28) | (zlib.crc32(repr([u.channel for u in units]).encode()) & ((1 << 28) - 1))


class Bucket:
    """Consecutive units with one key whose gathers and reductions are one collective each."""

    def __init__(self, units: list[ShardedUnit]):
        self.units = units
        first = units[0]
        self.group, self.world, self.rank = first.group, first.world, first.rank
        self.replicate, self.replicate_size = first.replicate, first.replicate_size
        self.label = f"{first.label} .. {units[-1].label} ({len(units)} units)"
        self.channel = _channel(units)
        self.shard_numel = sum(u.flat_shard.numel() for u in units)
        # where each member's flat shard lies in a rank's row, and its gradient rows
        self._at, at = {}, 0
        for u in units:
            self._at[u] = (at, u.flat_shard.numel())
            at += u.flat_shard.numel()
        self.trainable = [u for u in units if u.num_trainable]
        self._grad_at, at = {}, 0
        for u in self.trainable:
            self._grad_at[u] = (at, u.grad_layout.sizes[0])
            at += u.grad_layout.sizes[0]
        self.grad_numel = at
        self._rows: C.ScatterRows | None = None
        self._packed = 0
        self.occupancy = Occupancy()  # its members', which the runtime's counts as one gather
        for u in units:
            u.bucket = self

    def dissolve(self) -> None:
        for u in self.units:
            u.bucket = None

    # --- the gather
    def gather(self) -> None:
        """Issue one all-gather of every member's flat shard (no wait): the members that are
        sharded become GATHERING; the others' parts go unused (every rank sends them alike)."""
        first, n = self.units[0], self.shard_numel
        # every rank's message lands in one rank-major buffer (this rank's is sent from it), so
        # that a member's part is one (N, k) block: one copy-out per member, not one per rank
        into = torch.empty(self.world * n, dtype=first.compute_dtype, device=first.device)
        mine = into[self.rank * n : (self.rank + 1) * n]
        shards = [u.flat_shard for u in self.units]
        if mine.dtype == first.flat_shard.dtype:
            torch.cat(shards, out=mine)
        else:
            mine.copy_(torch.cat(shards))  # (the cast of each unit's own gather)
        pending = C.all_gather(mine, self.group, self.label, self.channel, into=into)
        for u in self.units:
            if u.state is UnitState.SHARDED:
                u._send, u._gather = into, pending  # (each holds the buffer until its copy-out)
                u.enter(UnitState.GATHERING)
                if events.listeners:
                    events.emit("gather_issue", u.label, bytes=u.flat_full.numel() * u.flat_full.element_size())

    def rows_of(self, unit: ShardedUnit) -> torch.Tensor:
        """``unit``'s part of every rank's message, as an (N, k) block of the rank-major buffer
        it holds (after the wait)."""
        start, n = self._at[unit]
        return unit._send.view(self.world, self.shard_numel)[:, start : start + n]

    # --- the reduction
    def pack(self, unit: ShardedUnit, grads: list[torch.Tensor]) -> bool:
        """Lay ``unit``'s full gradients out in its part of the bucket's rows; once every
        trainable member has, issue the reduce-scatter. Whether it was issued now."""
        if self._rows is None:
            self._rows = C.scatter_rows((self.grad_numel,) * self.world, unit.reduce_dtype, unit.device, self.group)
        start, n = self._grad_at[unit]
        rows = [row[start : start + n] for row in self._rows.rows]
        unit.grad_layout.pack(grads, rows)
        if unit.reduce_dtype.itemsize < 4:  # as ShardedUnit.reduce_grads: divided before the sum
            for row in rows:
                row.div_(self.world * self.replicate_size)
        self._packed += 1
        if self._packed < len(self.trainable):
            return False
        buf, self._rows, self._packed = self._rows, None, 0
        pending = C.reduce_scatter(buf, self.group, self.label, self.channel)
        stages = [self._replicate_all_reduce(buf.out)] if self.replicate is not None else []
        for u in self.trainable:
            s, k = self._grad_at[u]
            u.take_reduction(pending, buf.out[s : s + k], stages)
        return True

    def _replicate_all_reduce(self, out: torch.Tensor):
        """Hybrid sharding's stage after the reduce-scatter: the all-reduce across replicas of
        the whole reduced shard ``out``, issued by the first member to move its reduction on
        and shared by the others (only they hold it: the bucket keeps no buffer past a step)."""
        issued: list[C.Pending] = []

        def stage(_part: torch.Tensor) -> C.Pending:
            if not issued:
                issued.append(C.all_reduce(out, self.replicate, self.label, kind="replicate_all_reduce", channel=self.channel))
            return issued[0]

        return stage

    def unpacked(self) -> list[ShardedUnit]:
        """Where some members packed their gradients and others not (units that did not run
        this step): those others, which complete the reduction (with zeros, or what they hold)."""
        if not self._packed:
            return []
        return [u for u in self.trainable if not u.reduce_issued]

    def reset(self) -> None:
        """Drop a reduction half packed (after a step that raised: every rank drops it alike)."""
        self._rows = None
        self._packed = 0
