"""Delta mode: which of this rank's rows changed since the last push, as vLLM's sparse
engine and verl's ``delta_sharded`` send them.

Each rank keeps the rows it answers for (``source.local_rows``) as last pushed, in the wire
dtype, and compares the new ones bit for bit in that dtype: a bf16 value changes only when an
update crosses a rounding step, which at RL learning rates most do not. What changed goes as
flat indices and values, or as the rows themselves where that is smaller. No rank holds more
than its own rows' copy: memory and comparison work shrink with the number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class Patch:
    """What one rank sends for one tensor: dense rows from ``first`` (``indices`` None) or
    the values at flat ``indices``."""

    export: int  # the export's position in the push
    first: int
    values: torch.Tensor
    indices: torch.Tensor | None = None


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

    def patch(self, export: int, first: int, rows: torch.Tensor, dtype: torch.dtype) -> Patch | None:
        """The change of these rows since the last push (None: unchanged), and remember them."""
        cur = rows.reshape(-1).to(dtype)
        old = self.rows[export]
        bits = _BITS[dtype.itemsize]
        changed = (cur.view(bits) != old.view(bits)).nonzero().view(-1)
        if changed.numel() == 0:
            return None
        if changed.numel() * (1 + dtype.itemsize) >= cur.numel() * dtype.itemsize:
            old.copy_(cur)  # (a patch takes at least a byte per index besides the value)
            return Patch(export, first, old)
        values = cur[changed]
        old[changed] = values
        return Patch(export, first, values, changed + first)
