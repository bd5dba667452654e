"""Delta mode: which of this rank's rows changed since the last push, as vLLM's sparse
engine and verl's ``delta_sharded`` send them.

Each rank keeps the rows it answers for (``source.local_rows``) as last pushed, in the wire
dtype, and compares the new ones bit for bit in that dtype: a bf16 value changes only when an
update crosses a rounding step, which at RL learning rates most do not. What changed goes as
flat indices and, for each, the number of representable steps it moved (one signed byte: at
RL learning rates nearly every change is a step or two; the bit patterns of same-signed
floats are ordered) or its new value where it moved further; rows where that is no smaller
go whole. The engine holds exactly what was sent, so it applies steps to the same bits. No
rank holds more than its own rows' copy: memory and comparison work shrink with the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class Patch:
    """What one rank sends for one tensor: dense rows from ``first`` (``indices`` None), the
    new values at flat ``indices``, or (``steps``) how many steps each value there moved."""

    export: int  # the export's position in the push
    first: int
    values: torch.Tensor
    indices: torch.Tensor | None = None
    steps: bool = False


class Shadow:
    """This rank's rows of every export as last pushed (``valid`` after a push that
    completed: a failed push leaves the engine's copy unknown, so the next push is full)."""

    def __init__(self):
        self.rows: dict[int, torch.Tensor] = {}
        self.valid = False

    def reset(self) -> None:
        self.rows, self.valid = {}, False

    def store(self, export: int, rows: torch.Tensor, dtype: torch.dtype) -> None:
        """After a full push: remember the rows sent."""
        self.rows[export] = rows.reshape(-1).to(dtype, copy=True)

    def patch(self, export: int, first: int, rows: torch.Tensor, dtype: torch.dtype) -> list[Patch]:
        """The change of these rows since the last push ([] when none), and remember them."""
        cur = rows.reshape(-1).to(dtype)
        old = self.rows[export]
        bits = BITS[dtype.itemsize]
        wide = torch.int64 if dtype.itemsize == 8 else torch.int32
        moved = cur.view(bits).to(wide) - old.view(bits).to(wide)  # steps between bit patterns
        changed = moved != 0
        n_changed = int(changed.sum())
        if n_changed == 0:
            return []
        near = changed & (moved >= -128) & (moved <= 127)
        n_near = int(near.sum())
        # at least a byte of index each, and a byte of steps or a whole value
        if 2 * n_near + (1 + dtype.itemsize) * (n_changed - n_near) >= cur.numel() * dtype.itemsize:
            old.copy_(cur)
            return [Patch(export, first, old)]
        out = []
        if n_near:
            out.append(Patch(export, first, moved[near].to(torch.int8), near.nonzero().view(-1) + first, steps=True))
        if n_near < n_changed:
            far = changed & ~near
            out.append(Patch(export, first, cur[far], far.nonzero().view(-1) + first))
        old.copy_(cur)
        return out
