"""What a load works out before anything changes (``LoadPlan``), the ranks' agreement on its
problems, and what ``load`` returns (``CheckpointInfo``): shared by the loads of both formats
(loading.py, dcp_loading.py), which build on it rather than on each other.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open

from ..core import collectives as C
from ..core.policies import Sharding
from . import files
from .index import CheckpointError, Piece


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``load()`` found besides the tensors."""

    path: Path
    step: int | None  # as given to save()
    extra: Any  # as given to save() (rank 0's)
    world_size: int | None  # of the save (None: a DCP checkpoint that shardwise did not write)
    strategy: Sharding | None  # of the save (likewise)
    rng_restored: bool  # each rank's RNG states were restored (only at the saved world size)


def listed(names: list[str], limit: int = 10) -> str:
    """``names`` quoted for a message, the first ``limit`` of them."""
    shown = ", ".join(f"'{n}'" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


class LoadPlan:
    """One load, worked out before anything changes: the problems found, the copies to make,
    and the files they read (each opened once and, for a checkpoint, verified once)."""

    def __init__(self, stack: ExitStack, root: Path | None, files_meta: dict[str, dict] | None):
        self.stack, self.root, self.files_meta = stack, root, files_meta
        self.problems: list[str] = []
        self.copies: list[Callable[[], None]] = []
        self._handles: dict[str, Any] = {}

    def problem(self, msg: str) -> None:
        self.problems.append(msg)

    def open(self, file: str):
        """The open file, or None after recording why it cannot be used."""
        if file in self._handles:
            return self._handles[file]
        self._handles[file] = None
        path = Path(file) if self.root is None else self.root / file
        if not path.is_file():
            self.problem(f"file {file} is missing" + (f" from {self.root}" if self.root else ""))
            return None
        if self.files_meta is not None:
            want = self.files_meta.get(file)
            size, crc = files.checksum(path)
            if want is None:
                self.problem(f"file {file} is not listed in the index")
                return None
            if size != want["bytes"]:
                self.problem(
                    f"file {file} has {size} bytes, the index records {want['bytes']}: "
                    "it is truncated or was replaced"
                )
                return None
            if crc != want["crc32"]:
                self.problem(
                    f"file {file} is corrupt: its CRC-32 is {crc}, "
                    f"the index records {want['crc32']}"
                )
                return None
        try:
            self._handles[file] = self.stack.enter_context(safe_open(path, framework="pt"))
        except Exception as e:  # safetensors raises its own error type for a bad header
            self.problem(f"file {file} is not a readable safetensors file ({e})")
        return self._handles[file]

    def rows(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype | None,
        pieces: list[Piece],
        lo: int,
        hi: int,
        dest: torch.Tensor,
    ) -> None:
        """Plan to copy rows ``[lo, hi)`` of tensor ``name`` into ``dest`` (shaped
        ``(hi - lo, *shape[1:])``) from the pieces that hold them; ``dtype`` None casts."""
        for p in pieces:
            a, b = max(lo, p.start), min(hi, p.stop)
            if a >= b:
                continue
            handle = self.open(p.file)
            if handle is None:
                continue
            try:
                part = handle.get_slice(name)
            except Exception:
                self.problem(
                    f"file {p.file} has no tensor '{name}' although the index says it holds "
                    f"its rows {p.start}..{p.stop}"
                )
                continue
            stored = tuple(part.get_shape())
            want = (p.stop - p.start, *shape[1:]) if shape else ()
            if stored != want or (
                dtype is not None and part.get_dtype() != files.dtype_code(dtype)
            ):
                self.problem(
                    f"tensor '{name}' in file {p.file} is stored as "
                    f"{part.get_dtype()} {list(stored)}, "
                    f"expected {files.dtype_code(dtype) if dtype else 'a tensor of'} {list(want)}"
                )
                continue
            self.copies.append(
                functools.partial(_copy, dest, lo, handle, name, shape, p.start, a, b)
            )


def _copy(
    dest: torch.Tensor, lo: int, handle, name: str, shape, first: int, a: int, b: int
) -> None:
    dest[a - lo : b - lo].copy_(files.read_rows(handle, name, shape, first, a, b))


def agree_on_problems(plan: LoadPlan, what: str, group) -> None:
    """Raise on every rank if any rank found a problem (a collective)."""
    everyone: list = [None] * dist.get_world_size(group)
    C.blocking("all_gather", "checkpoint load agreement", dist.all_gather_object, everyone, plan.problems, group=group)
    merged = list(dict.fromkeys(p for problems in everyone for p in problems))
    if merged:
        raise CheckpointError(f"{what}; nothing was changed: " + "; ".join(merged))
