"""How one unit's parameters map onto flat buffers and onto the ranks of its group.

Each parameter has a placement (Note [placement]):
- rows (dim-0 sharding): rank k holds rows [k*R, (k+1)*R) of it, R = ceil(rows / N), so a
  shard is shaped like its parameter (natural optimizer state, state dicts, resharding);
- owned: one rank, its owner, holds it whole; the others hold none of it.
A 0-dim parameter counts as one row of one element. Each rank keeps its pieces of a unit in one
flat buffer (segment i holds its R rows of parameter i, zero padded, or the whole of an owned
parameter on its owner, or nothing), which is exactly what the rank contributes to the unit's
gather: no copy-in. With owned parameters the ranks' buffers differ in size (``sizes``). A
gather yields every rank's flat buffer; ``unpack`` copies them out to the parameter-major
unsharded buffer whose slices are the full parameters, and ``pack`` is the reverse for
gradients (an owned parameter's gradient goes whole to its owner: a reduce).

Note [placement]: placement is per parameter and it is data: gathers, reductions, the
optimizer's view, checkpoints, the planner and the tracer all read the slot, none asks which
optimizer runs. An optimizer that needs whole matrices (Muon, Adafactor) runs unchanged on
the owners, with nothing to communicate in its step.

Pure tensor bookkeeping: no process group here, unit-tested on its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class Slot:
    """One parameter's place in a unit's layout."""

    name: str  # qualified name of the parameter (its first name, for a shared parameter)
    shape: tuple[int, ...]  # unsharded shape
    rows_per_rank: int  # R: rows every rank holds, padding included (owned: all rows)
    offsets: tuple[int, ...]  # per rank: element offset of this parameter's segment in its flat shard
    owner: int | None = None  # the rank that holds it whole; None: rows on every rank

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @cached_property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1

    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def owned(self) -> bool:
        return self.owner is not None

    def numel_on(self, rank: int) -> int:
        """Elements of this parameter's segment in ``rank``'s flat shard, padding included."""
        if self.owner is None:
            return self.rows_per_rank * self.row_numel
        return self.numel if rank == self.owner else 0

    def full_numel(self, world: int) -> int:
        """Elements of its part of the unsharded buffer (rows: every rank's padded segment)."""
        return world * self.rows_per_rank * self.row_numel if self.owner is None else self.numel

    def row_range(self, rank: int) -> tuple[int, int]:
        """The rows ``[start, stop)`` of the unsharded parameter that ``rank`` holds."""
        if self.owner is not None:
            return (0, self.rows) if rank == self.owner else (0, 0)
        start = min(rank * self.rows_per_rank, self.rows)
        return start, min(start + self.rows_per_rank, self.rows)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s piece without padding (0 rows where a rank holds none)."""
        start, stop = self.row_range(rank)
        return (stop - start, *self.shape[1:])


@dataclass(frozen=True)
class Layout:
    """The flat layout of a unit's parameters over ``world_size`` ranks."""

    slots: tuple[Slot, ...]
    world_size: int

    @staticmethod
    def build(
        named_shapes: list[tuple[str, tuple[int, ...]]],
        world_size: int,
        owners: Sequence[int | None] | None = None,
    ) -> Layout:
        """Lay parameters out in order; ``owners[i]`` is parameter i's owner (None: rows)."""
        owners = owners if owners is not None else [None] * len(named_shapes)
        slots, offsets = [], [0] * world_size
        for (name, shape), owner in zip(named_shapes, owners):
            rows = shape[0] if shape else 1
            per_rank = rows if owner is not None else -(-rows // world_size)
            slot = Slot(name, tuple(shape), per_rank, tuple(offsets), owner)
            slots.append(slot)
            offsets = [o + slot.numel_on(r) for r, o in enumerate(offsets)]
        return Layout(tuple(slots), world_size)

    def subset(self, keep: list[bool]) -> Layout:
        """The layout of the kept slots alone (e.g. the trainable ones, for gradients)."""
        kept = [s for s, k in zip(self.slots, keep) if k]
        return Layout.build([(s.name, s.shape) for s in kept], self.world_size, [s.owner for s in kept])

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        """Elements of each rank's flat shard, padding included."""
        return tuple(sum(s.numel_on(r) for s in self.slots) for r in range(self.world_size))

    @cached_property
    def uniform(self) -> bool:
        """Every parameter in rows: every rank's flat shard has the same size."""
        return not any(s.owned for s in self.slots)

    @property
    def unsharded_numel(self) -> int:
        """Elements of the gathered buffer (padding rows included)."""
        return sum(s.full_numel(self.world_size) for s in self.slots)

    @property
    def numel(self) -> int:
        """Elements of the parameters themselves, without padding."""
        return sum(s.numel for s in self.slots)

    def shard_views(self, flat_shard: torch.Tensor, rank: int) -> list[torch.Tensor]:
        """Views of ``flat_shard`` shaped as this rank's unpadded pieces."""
        return [flat_shard[start:stop].view(shape) for start, stop, shape in self._pieces(rank)]

    def _pieces(self, rank: int) -> list[tuple[int, int, tuple[int, ...]]]:
        """Where each of ``rank``'s unpadded pieces lies in its flat shard, and its shape
        (worked out once per rank: every reduction asks)."""
        pieces = self._pieces_of.get(rank)
        if pieces is None:
            pieces = self._pieces_of[rank] = []
            for s in self.slots:
                start, stop = s.row_range(rank)
                o = s.offsets[rank]
                pieces.append((o, o + (stop - start) * s.row_numel, s.local_shape(rank)))
        return pieces

    @cached_property
    def _pieces_of(self) -> dict[int, list[tuple[int, int, tuple[int, ...]]]]:
        return {}

    def unsharded_views(self, flat_full: torch.Tensor) -> list[torch.Tensor]:
        """Views of the parameter-major unsharded buffer shaped as the full parameters."""
        views, start = [], 0
        for s in self.slots:
            views.append(flat_full[start : start + s.numel].view(s.shape))
            start += s.full_numel(self.world_size)
        return views

    def _targets(self, flat_full: torch.Tensor, rank: int) -> list[torch.Tensor]:
        """Where each segment of ``rank``'s flat shard lands in the unsharded buffer."""
        out, start = [], 0
        for s in self.slots:
            k = s.numel_on(rank)
            if s.owner is None:
                out.append(flat_full[start + rank * k : start + (rank + 1) * k])
            elif k:
                out.append(flat_full[start : start + k])
            start += s.full_numel(self.world_size)
        return out

    def unpack(self, rows: Sequence[torch.Tensor] | torch.Tensor, flat_full: torch.Tensor) -> None:
        """Copy every rank's flat shard (``rows[r]``: rank r's) into its place in the
        parameter-major unsharded buffer: one copy per rank, or one in all for a uniform
        layout when ``rows`` is a single rank-major tensor (an NCCL gather's output; with
        owned parameters its rows are padded to the largest rank's size)."""
        self.unpacker(flat_full)(rows)

    def unpacker(self, flat_full: torch.Tensor) -> Callable[[Sequence[torch.Tensor] | torch.Tensor], None]:
        """``unpack`` into ``flat_full`` with the split sizes and target views worked out once
        (a unit unpacks every gather into the same buffer)."""
        n, uniform = self.world_size, self.uniform
        if uniform:  # the rank-major tensor's column blocks, one per parameter
            widths = [s.numel_on(0) for s in self.slots]
            blocks = [seg.view(n, k) for seg, k in zip(torch.split(flat_full, [n * k for k in widths]), widths)]
        per_rank: list[tuple[int, list[int], list[torch.Tensor]]] = []  # (at the first rank by rank)

        def unpack(rows: Sequence[torch.Tensor] | torch.Tensor) -> None:
            if uniform and isinstance(rows, torch.Tensor):
                torch.split_with_sizes_copy(rows.view(n, -1), widths, dim=1, out=blocks)
                return
            if not per_rank:  # (N x slots views: made when first needed, as an NCCL gather never does)
                per_rank.extend(
                    (self.sizes[r], [s.numel_on(r) for s in self.slots if s.owner is None or s.numel_on(r)],
                     self._targets(flat_full, r))
                    for r in range(n)
                )
            for row, (size, sizes, targets) in zip(rows, per_rank):
                torch.split_with_sizes_copy(row.view(-1)[:size], sizes, out=targets)

        return unpack

    def segments(self, rows: Sequence[torch.Tensor] | torch.Tensor, index: int) -> list[tuple[int, torch.Tensor]]:
        """Parameter ``index`` in gathered rows (``rows[r]``: rank r's flat shard, as ``unpack``
        takes them), without a copy: ``(start, flat view)`` pairs that together hold its
        elements, ``start`` counting from its first element (one pair for an owned parameter,
        one per rank holding rows otherwise; padding left out)."""
        s = self.slots[index]
        if s.owner is not None:
            o = s.offsets[s.owner]
            return [(0, rows[s.owner].view(-1)[o : o + s.numel])]
        k, out = s.rows_per_rank * s.row_numel, []
        for r in range(self.world_size):
            n = min(k, s.numel - r * k)
            if n <= 0:
                break
            out.append((r * k, rows[r].view(-1)[s.offsets[r] : s.offsets[r] + n]))
        return out

    def pack(
        self, full: list[torch.Tensor], rows: Sequence[torch.Tensor], whole: torch.Tensor | None = None
    ) -> None:
        """Lay full tensors (one per slot) out as every rank's flat shard: ``rows[r]`` gets
        rank r's (the input of a reduce-scatter), cast to its dtype. ``whole``: the rows as
        one rank-major tensor (NCCL's); for a uniform layout each slot is then written into
        its column block at once (a few copies per parameter, however many ranks: the reverse
        of ``unpack``'s one copy), not rank by rank."""
        if whole is None or not self.uniform:
            for r, row in enumerate(rows):
                self.pack_row(full, r, row)
            return
        at = 0
        for s, t in zip(self.slots, full):
            k = s.numel_on(0)
            block, flat = whole[:, at : at + k], t.reshape(-1)  # (N, k): every rank's segment
            done, rest = divmod(s.numel, k)
            if done:
                block[:done].copy_(flat[: done * k].view(done, k))
            if rest:
                block[done, :rest].copy_(flat[done * k :])
                block[done, rest:].zero_()
                done += 1
            if done < self.world_size:
                block[done:].zero_()  # ranks that hold none of it
            at += k

    def pack_row(self, full: list[torch.Tensor], rank: int, out: torch.Tensor) -> None:
        """Write ``rank``'s flat shard of full tensors (one per slot) into ``out``, zero padded."""
        parts = []
        for i, start, stop, padding in self._row_plan(rank):
            flat = full[i].reshape(-1)
            parts.append(flat[start:stop])
            if padding:
                parts.append(flat.new_zeros(padding))
        if parts:
            torch.cat(parts, out=out.view(-1)[: self.sizes[rank]])

    def _row_plan(self, rank: int) -> list[tuple[int, int, int, int]]:
        """``pack_row``'s pieces for ``rank``: (slot, first element, end, zeros after), worked
        out once per rank."""
        plan = self._row_plans.get(rank)
        if plan is None:
            plan = self._row_plans[rank] = []
            for i, s in enumerate(self.slots):
                k = s.numel_on(rank)
                if k:
                    start = 0 if s.owned else min(rank * k, s.numel)
                    stop = min(start + k, s.numel)
                    plan.append((i, start, stop, k - (stop - start)))
        return plan

    @cached_property
    def _row_plans(self) -> dict[int, list[tuple[int, int, int, int]]]:
        return {}
