"""The trainer's weights as an inference engine loads them, read from the shards unit by unit.

Names and order are ``save_pretrained``'s (``checkpoint.pretrained``: a tied weight once,
persistent buffers, a peft model under its base model's names), with LoRA adapters folded
into their base weights as peft's ``merge_and_unload`` does: an engine serves the merged
model. A transformers model's tensors go under the names transformers' own ``save_pretrained``
writes (its conversion mapping reversed): Mixtral's fused ``mlp.experts.gate_up_proj`` as the
per-expert ``block_sparse_moe.experts.{i}.w1/w3``, each a contiguous range (a ``part``) of
the fused parameter. Two ways to read them, both collective over the model's ranks:

- ``Gathered(view, unit, exps, scratch)``: one unit's full parameters, gathered once over its group,
  handed out as segments of the gathered rows (no full copy is made, except for a merged LoRA
  weight). A unit whose exports are its parameters is gathered in the wire dtype (half the
  bytes of fp32 for bf16; casting commutes with gathering). On CPU the rows lie in the
  sync's ``Scratch``, memory of its own that it keeps until it closes.
- ``local_rows(view, export)``: the rows of an export this rank answers for, without a gather
  (its shard's rows; the delta mode's unit of work).

Both read through a view: ``Live`` (the units as they are, for a push between steps) or
``Frozen`` (this rank's rows copied at the push, gathered over the push's own groups, for a
push that overlaps the next steps).

``ShardwiseSource`` wraps both in vLLM's ``WeightSource`` for vLLM's own nccl and ipc engines.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import mmap
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from ..checkpoint.pretrained import (
    Exported,
    exported_tensors,
    is_peft,
    is_transformers,
    merged_names,
)
from ..checkpoint.state import idle_world_runtime, owned_rows
from ..core import collectives as C
from ..core import flight, groups
from ..core.errors import ShardwiseError
from ..core.runtime import Runtime
from ..core.unit import ShardedUnit


@dataclass(frozen=True)
class Export:
    """One tensor the engine gets."""

    name: str  # the engine's checkpoint name
    dtype: torch.dtype  # on the wire
    shape: tuple[int, ...]
    unit: int | None  # the unit whose parameter it is (None: a buffer, whole on every rank)
    index: int  # the parameter's slot in its unit
    buffer: torch.Tensor | None = None
    lora: tuple[int, int, float, bool] | None = None  # merged: slots of A and B, scale, transpose
    part: tuple[int, int] | None = None  # a range of the parameter: first element, count

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def row_numel(self) -> int:
        return self.numel // self.shape[0] if self.shape else 1


def exports(model: nn.Module, dtype: torch.dtype | None) -> list[Export]:
    """Every tensor the engine gets, unit by unit, then the buffers (floating-point ones in
    ``dtype``; None keeps each parameter's)."""
    rt = idle_world_runtime(model, "VLLMSync")
    tensors = list(exported_tensors(model, rt, dtype))
    if not is_peft(model):
        parts = checkpoint_parts(model, tensors) if is_transformers(model) else {}
        return [
            Export(name, t.dtype, shape, t.unit, t.index, t.buffer, part=part)
            for t in tensors
            for name, shape, part in parts.get(t.name, [(t.name, t.shape, None)])
        ]
    names, merges = merged_names(model, tensors)
    by_name = {t.name: t for t in tensors}
    out = []
    for t in tensors:
        if t.name not in names:
            continue
        lora = None
        if t.name in merges:
            m = merges[t.name]
            a, b = by_name[m.a], by_name[m.b]
            if a.unit != t.unit or b.unit != t.unit:
                raise ShardwiseError(
                    f"'{t.name}' and its LoRA adapters are in different units: wrap so that each "
                    "LoRA layer lies inside one unit (shardwise.wrap.auto(model) does)"
                )
            lora = (a.index, b.index, m.scale, m.transpose)
        out.append(Export(names[t.name], t.dtype, t.shape, t.unit, t.index, t.buffer, lora))
    return out


def checkpoint_parts(
    model: nn.Module, tensors: list[Exported]
) -> dict[str, list[tuple[str, tuple[int, ...], tuple[int, int] | None]]]:
    """Each tensor's names in transformers' ``save_pretrained`` (its conversion mapping
    reversed, by transformers itself), as ``(name, shape, part)``: one whole tensor renamed, or
    a parameter split into contiguous ranges (``part``: first element, count). Found by
    reversing the mapping on small index tensors (over a matrix's rows; over an expert stack's
    experts and rows, the dims transformers' expert fusing stacks and concatenates) and on
    meta tensors for the shapes; a tensor whose pieces are not contiguous ranges keeps its own
    name (the handshake then names it if the engine refuses it)."""
    from transformers.core_model_loading import revert_weight_conversion

    base, blocks, indices = {}, {}, {}
    first = 0
    for t in tensors:
        lead = t.shape[:2] if len(t.shape) > 2 else t.shape[:1]
        count = math.prod(lead)
        blocks[t.name] = math.prod(t.shape) // count if count else 0
        indices[t.name] = torch.arange(first, first + count).view(*lead, *([1] * (len(t.shape) - len(lead))))
        base[t.name] = first
        first += count
    reverted = revert_weight_conversion(model, indices)
    shapes = revert_weight_conversion(model, {t.name: torch.empty(t.shape, device="meta") for t in tensors})
    firsts, names = list(base.values()), list(base)  # firsts ascending, as assigned
    found: dict[str, list] = {}
    for name, idx in reverted.items():
        v = idx.reshape(-1)
        if not v.numel() or name not in shapes:
            continue
        src = names[bisect.bisect_right(firsts, int(v[0])) - 1]
        contiguous = bool((v == v[0] + torch.arange(v.numel())).all())
        start, count = (int(v[0]) - base[src]) * blocks[src], v.numel() * blocks[src]
        shape = tuple(shapes[name].shape)
        found.setdefault(src, []).append((name, shape, start, count, contiguous and math.prod(shape) == count))
    out = {}
    for t in tensors:
        pieces = sorted(found.get(t.name, []), key=lambda p: p[2])
        if len(pieces) == 1 and pieces[0][4] and pieces[0][3] == math.prod(t.shape):
            out[t.name] = [(pieces[0][0], t.shape, None)]
        elif (
            len(pieces) > 1
            and t.unit is not None
            and all(p[4] for p in pieces)
            and sum(p[3] for p in pieces) == math.prod(t.shape)
        ):
            out[t.name] = [(n, shape, (start, count)) for n, shape, start, count, _ in pieces]
    return out


def by_unit(exps: list[Export]) -> list[tuple[int | None, list[Export]]]:
    """Consecutive exports grouped by unit, in order (buffers last, as one group)."""
    groups: list[tuple[int | None, list[Export]]] = []
    for e in exps:
        if groups and groups[-1][0] == e.unit:
            groups[-1][1].append(e)
        else:
            groups.append((e.unit, [e]))
    return groups


def gather_dtype(unit: ShardedUnit, exps: list[Export]) -> torch.dtype:
    """The dtype a push gathers a unit in: the wire dtype when all its exports travel in one
    narrower than the master weights (half the bytes of fp32 for bf16; casting commutes with
    gathering) and none is a merged LoRA weight; else the master dtype."""
    master = unit.flat_shard.dtype
    wire = {e.dtype for e in exps}
    narrow = len(wire) == 1 and all(e.lora is None for e in exps) and next(iter(wire)).itemsize < master.itemsize
    return next(iter(wire)) if narrow else master


class Live:
    """What a push between steps reads: the units' own shards and parameters, gathered over
    their own groups like the training's gathers (recorded in the flight recorder); the
    control messages (status, patches, outcome) go over the world."""

    control = None  # the world group

    def __init__(self, rt: Runtime):
        self.rt = rt

    def shard(self, i: int) -> torch.Tensor:
        return self.rt.units[i].flat_shard

    def params(self, i: int) -> list[torch.Tensor]:
        return [p.detach() for p in self.rt.units[i].params]

    def buffer(self, e: Export) -> torch.Tensor:
        return e.buffer.detach()

    def group(self, i: int | None):
        """Unit ``i``'s group (None: the buffers', the shard group)."""
        return self.rt.units[i].group if i is not None else self.rt.mesh.shard

    def reading(self) -> contextlib.AbstractContextManager:
        """Around a pass over the units: under hybrid sharding only rank 0's shard group reads
        (the others hold the same rows), its collectives kept apart as ``save_pretrained`` does."""
        return flight.apart() if self.rt.mesh.replicate is not None else contextlib.nullcontext()

    def gather(self, i: int, dtype: torch.dtype, scratch: Scratch) -> list[torch.Tensor]:
        unit = self.rt.units[i]
        sizes, label = unit.layout.sizes, f"{unit.label} (push)"
        if unit.device.type == "cpu":
            into = scratch.take(sum(sizes), dtype)
            first = sum(sizes[: unit.rank])
            send = into[first : first + sizes[unit.rank]]
            send.copy_(unit.flat_shard)
            pending = C.all_gather(send, unit.group, label, unit.channel, sizes, into=into)
        else:
            send = unit.flat_shard.to(unit.device, dtype)
            pending = C.all_gather(send, unit.group, label, unit.channel, sizes)
        pending.wait()
        return pending.result


class Frozen(Live):
    """What a push that overlaps the next steps reads (``push(wait=False)``): this rank's rows
    as they were at the push, copied to host memory then (a sharded unit's shard in the dtype
    it is gathered in, a replicated unit's parameters, the buffers), so that the optimizer may
    step while they stream. Gathered over the push's own Gloo groups (``PushGroups``) as plain
    torch.distributed calls: not through the flight recorder, whose per-step digest is the
    training thread's sequence of collectives and would differ between ranks if a thread
    beside it recorded into it. Only rank 0's replica copies anything (the others send
    nothing)."""

    def __init__(self, rt: Runtime, groups: list[tuple[int | None, list[Export]]], push_groups: PushGroups):
        super().__init__(rt)
        self.control = push_groups.world
        self.unit_groups = push_groups.units
        self.shards: dict[int, torch.Tensor] = {}
        self.unit_params: dict[int, list[torch.Tensor]] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        if not rt.mesh.in_first_shard_group():
            return
        with torch.no_grad():
            for i, exps in groups:
                if i is None:
                    for e in exps:
                        self.buffers[e.name] = e.buffer.detach().to("cpu", copy=True)
                elif isinstance(rt.units[i], ShardedUnit):
                    unit = rt.units[i]
                    self.shards[i] = unit.flat_shard.detach().to("cpu", gather_dtype(unit, exps), copy=True)
                else:
                    self.unit_params[i] = [p.detach().to("cpu", copy=True) for p in rt.units[i].params]

    def shard(self, i: int) -> torch.Tensor:
        return self.shards[i]

    def params(self, i: int) -> list[torch.Tensor]:
        return self.unit_params[i]

    def buffer(self, e: Export) -> torch.Tensor:
        return self.buffers[e.name]

    def group(self, i: int | None):
        return self.unit_groups[_ranks(super().group(i))]

    def reading(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def gather(self, i: int, dtype: torch.dtype, scratch: Scratch) -> list[torch.Tensor]:
        unit = self.rt.units[i]
        sizes, mine = unit.layout.sizes, self.shards[i]
        if len(sizes) == 1:
            return [mine]
        width = max(sizes)  # Gloo gathers equal pieces: ragged ones padded to the widest
        rows = list(scratch.take(width * len(sizes), dtype).view(len(sizes), width).unbind(0))
        rows[unit.rank][: mine.numel()].copy_(mine)
        C.blocking("all_gather", f"{unit.label} (push)", dist.all_gather, rows, rows[unit.rank], group=self.group(i))
        return [row[:n] for row, n in zip(rows, sizes)]


@dataclass
class PushGroups:
    """The Gloo groups a push beside training talks over, its own so that its collectives
    never interleave with the training thread's: one over the world (the push's status,
    patches and outcome) and one per group of ranks that gathers units (``units``: by ranks)."""

    world: object
    units: dict[tuple[int, ...], object]

    @classmethod
    def create(cls, rt: Runtime) -> PushGroups:
        """Collective: every rank calls it, on its main thread, in the same order."""
        world = groups.background_group()
        mine = {_ranks(u.group) for u in rt.units} | {_ranks(rt.mesh.shard)} if rt.mesh.in_first_shard_group() else set()
        every = [None] * dist.get_world_size()
        C.blocking("all_gather", "VLLMSync push groups", dist.all_gather_object, every, sorted(mine))
        units = {}
        for ranks in sorted({tuple(r) for rs in every for r in rs}):
            if ranks == tuple(range(dist.get_world_size())):
                units[ranks] = world
            else:  # every rank creates every group (torch's rule), members use theirs
                group = groups.background_group(list(ranks))
                if dist.get_rank() in ranks:
                    units[ranks] = group
        return cls(world, units)


def _ranks(group) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))


class Scratch:
    """Gather memory on CPU: one anonymous mapping, reused unit after unit and push after push
    (remapped larger when a unit needs more), unmapped when its owner drops it.

    Not the heap: glibc serves allocations below its mmap threshold from its heap and keeps
    them resident after they are freed, and it raises that threshold to the size of each
    mapped chunk freed (up to 32 MiB). So after the first push a unit's gather came from the
    heap, stayed resident, was split by later small allocations, and a later push grew the
    heap by up to the largest unit again (docs/rl.md, "Measured"). Kept between pushes, not
    mapped afresh for each: faulting the pages in again cost a push on shared memory more
    than the gather itself."""

    def __init__(self):
        self.map: mmap.mmap | None = None

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of ``dtype``, valid until the next ``take``."""
        nbytes = numel * dtype.itemsize
        if self.map is None or len(self.map) < nbytes:
            self.map = mmap.mmap(-1, max(nbytes, 1))  # the old one goes when its last view does
        return torch.frombuffer(self.map, dtype=dtype, count=numel) if numel else torch.empty(0, dtype=dtype)


class Gathered:
    """One unit's parameters as ``view`` reads them (``Live`` or ``Frozen``), gathered over
    its group (collective); on CPU into ``scratch``."""

    def __init__(self, view: Live, i: int, exps: list[Export], scratch: Scratch):
        self.unit = view.rt.units[i]
        self.sharded = isinstance(self.unit, ShardedUnit)
        self.merged: dict[int, torch.Tensor] = {}
        if self.sharded:
            self.rows = view.gather(i, gather_dtype(self.unit, exps), scratch)
        else:
            self.params = view.params(i)

    def segments(self, e: Export) -> list[tuple[int, torch.Tensor]]:
        """``e``'s elements as ``(start, flat tensor)`` pairs."""
        if e.lora is not None:
            return [(0, self.merged_value(e).view(-1))]
        if e.part is None:
            return self._segments(e.index)
        first, count = e.part
        out = []
        for start, seg in self._segments(e.index):
            lo, hi = max(start, first), min(start + seg.numel(), first + count)
            if lo < hi:
                out.append((lo - first, seg[lo - start : hi - start]))
        return out

    def full(self, index: int) -> torch.Tensor:
        """A unit parameter whole (a fresh tensor unless the unit is replicated)."""
        if not self.sharded:
            return self.params[index]
        slot = self.unit.layout.slots[index]
        out = torch.empty(slot.numel, dtype=self.rows[0].dtype, device=self.rows[0].device)
        for start, seg in self._segments(index):
            out[start : start + seg.numel()].copy_(seg)
        return out.view(slot.shape)

    def merged_value(self, e: Export) -> torch.Tensor:
        """A LoRA layer's base weight with the adapter folded in, in fp32 (computed once)."""
        if e.index not in self.merged:
            ia, ib, scale, transpose = e.lora
            a, b = self.full(ia).float(), self.full(ib).float()
            delta = b @ a
            self.merged[e.index] = self.full(e.index).float() + scale * (delta.T if transpose else delta)
        return self.merged[e.index]

    def _segments(self, index: int) -> list[tuple[int, torch.Tensor]]:
        if not self.sharded:
            return [(0, self.params[index].view(-1))]
        return self.unit.layout.segments(self.rows, index)


def local_rows(view: Live, e: Export, gathered: Gathered | None) -> tuple[int, torch.Tensor] | None:
    """The rows of ``e`` this rank answers for in delta mode, as ``(first element, rows)``, or
    None. A sharded parameter's are its shard's rows (no gather); a replicated one's and a
    merged one's are split by rows like a shard (the merged one from ``gathered``); a buffer's
    are all on rank 0. Only rank 0's shard group answers (hybrid: the others hold the same)."""
    if e.unit is None:
        return (0, view.buffer(e).view(e.shape)) if dist.get_rank() == 0 else None
    unit = view.rt.units[e.unit]
    if e.lora is None and isinstance(unit, ShardedUnit):
        slot = unit.layout.slots[e.index]
        start, stop = slot.row_range(unit.rank)
        if stop <= start:
            return None
        rows = unit.layout.shard_views(view.shard(e.unit), unit.rank)[e.index]
        if e.part is None:
            return start * e.row_numel, rows
        return _within(e, start * math.prod(slot.shape[1:]), rows.reshape(-1))
    start, stop = owned_rows(e.shape, unit.rank, unit.world)
    if stop <= start:
        return None
    if e.lora is not None:
        whole = gathered.merged_value(e)
    elif e.part is not None:
        whole = view.params(e.unit)[e.index].reshape(-1)[e.part[0] : e.part[0] + e.part[1]]
    else:
        whole = view.params(e.unit)[e.index]
    return start * e.row_numel, whole.reshape(-1, *e.shape[1:])[start:stop]


def _within(e: Export, start: int, flat: torch.Tensor) -> tuple[int, torch.Tensor] | None:
    """The part of a shard's elements (``flat``, from element ``start`` of the parameter) that
    lies in ``e.part``, as whole rows of ``e``."""
    first, count = e.part
    lo, hi = max(start, first), min(start + flat.numel(), first + count)
    if hi <= lo:
        return None
    if (lo - first) % e.row_numel or (hi - first) % e.row_numel:
        raise ShardwiseError(
            f"'{e.name}' is a range of a fused parameter whose shard boundary splits one of its rows: "
            "delta=True cannot send it row by row; push with delta=False"
        )
    return lo - first, flat[lo - start : hi - start].view(-1, *e.shape[1:])
