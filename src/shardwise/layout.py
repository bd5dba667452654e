"""How one unit's parameters map onto flat buffers and onto N equal shards.

Row (dim-0) sharding: rank k owns rows [k*R, (k+1)*R) of every parameter, R = ceil(rows / N),
so a shard is shaped like its parameter (natural optimizer state, state dicts, resharding).
A 0-dim parameter counts as one row of one element. Each rank keeps its shards of a unit in one
flat buffer of ``shard_numel`` elements (segment i holds parameter i's R rows, zero padded),
which is exactly the input of the unit's all-gather: no copy-in. A gather yields every rank's
flat shard (this rank's is its own buffer); ``unpack`` copies them out to the parameter-major
unsharded buffer whose slices are the full parameters, and ``pack`` is the reverse for
gradients.

Pure tensor bookkeeping: no process group here, unit-tested on its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Slot:
    """One parameter's place in a unit's layout."""

    name: str  # qualified name of the parameter (its first name, for a shared parameter)
    shape: tuple[int, ...]  # unsharded shape
    rows_per_rank: int  # R: rows every rank holds, padding included
    offset: int  # element offset of this parameter's segment in the flat shard

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def shard_numel(self) -> int:
        """Elements of this parameter's segment on every rank, padding included."""
        return self.rows_per_rank * self.row_numel

    def row_range(self, rank: int) -> tuple[int, int]:
        """The rows ``[start, stop)`` of the unsharded parameter that ``rank`` owns."""
        start = min(rank * self.rows_per_rank, self.rows)
        return start, min(start + self.rows_per_rank, self.rows)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s shard without padding (0 rows where a rank owns none)."""
        start, stop = self.row_range(rank)
        return (stop - start, *self.shape[1:])


@dataclass(frozen=True)
class Layout:
    """The flat layout of a unit's parameters over ``world_size`` ranks."""

    slots: tuple[Slot, ...]
    world_size: int

    @staticmethod
    def build(named_shapes: list[tuple[str, tuple[int, ...]]], world_size: int) -> Layout:
        slots, offset = [], 0
        for name, shape in named_shapes:
            rows = shape[0] if shape else 1
            slot = Slot(name, tuple(shape), -(-rows // world_size), offset)
            slots.append(slot)
            offset += slot.shard_numel
        return Layout(tuple(slots), world_size)

    def subset(self, keep: list[bool]) -> Layout:
        """The layout of the kept slots alone (e.g. the trainable ones, for gradients)."""
        return Layout.build([(s.name, s.shape) for s, k in zip(self.slots, keep) if k], self.world_size)

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's flat shard, padding included."""
        return sum(s.shard_numel for s in self.slots)

    @property
    def unsharded_numel(self) -> int:
        """Elements of the gathered buffer: ``world_size * shard_numel`` (padding included)."""
        return self.world_size * self.shard_numel

    @property
    def numel(self) -> int:
        """Elements of the parameters themselves, without padding."""
        return sum(s.numel for s in self.slots)

    def shard_views(self, flat_shard: torch.Tensor, rank: int) -> list[torch.Tensor]:
        """Views of ``flat_shard`` shaped as this rank's unpadded shards."""
        views = []
        for s in self.slots:
            start, stop = s.row_range(rank)
            n = (stop - start) * s.row_numel
            views.append(flat_shard[s.offset : s.offset + n].view(s.local_shape(rank)))
        return views

    def unsharded_views(self, flat_full: torch.Tensor) -> list[torch.Tensor]:
        """Views of the parameter-major unsharded buffer shaped as the full parameters."""
        views, start = [], 0
        for s in self.slots:
            views.append(flat_full[start : start + s.numel].view(s.shape))
            start += self.world_size * s.shard_numel
        return views

    def unpack(self, rows: Sequence[torch.Tensor] | torch.Tensor, flat_full: torch.Tensor) -> None:
        """Copy every rank's flat shard (``rows[r]``: rank r's) into its rows of each
        parameter in the parameter-major unsharded buffer: one copy per row, or one in all
        when ``rows`` is a single rank-major tensor (an NCCL gather's output)."""
        n = self.world_size
        sizes = [s.shard_numel for s in self.slots]
        segments = torch.split(flat_full, [n * k for k in sizes])
        if isinstance(rows, torch.Tensor):
            outs = [seg.view(n, k) for seg, k in zip(segments, sizes)]
            torch.split_with_sizes_copy(rows.view(n, -1), sizes, dim=1, out=outs)
            return
        for r, row in enumerate(rows):
            outs = [seg[r * k : (r + 1) * k] for seg, k in zip(segments, sizes)]
            torch.split_with_sizes_copy(row.view(-1), sizes, out=outs)

    def pack(self, full: list[torch.Tensor], rows: Sequence[torch.Tensor]) -> None:
        """Lay full tensors (one per slot) out as every rank's flat shard: ``rows[r]`` gets
        rank r's (the input of a reduce-scatter), cast to its dtype."""
        for r, row in enumerate(rows):
            self.pack_row(full, r, row)

    def pack_row(self, full: list[torch.Tensor], rank: int, out: torch.Tensor) -> None:
        """Write ``rank``'s flat shard of full tensors (one per slot) into ``out``, zero padded."""
        parts = []
        for s, t in zip(self.slots, full):
            flat = t.reshape(-1)
            start = min(rank * s.shard_numel, s.numel)
            stop = min(start + s.shard_numel, s.numel)
            parts.append(flat[start:stop])
            if stop - start < s.shard_numel:
                parts.append(flat.new_zeros(s.shard_numel - (stop - start)))
        torch.cat(parts, out=out.view(-1))
