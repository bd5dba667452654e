"""The bucket format both sides of a push share: tensors, pieces of tensors and sparse patches
packed into one flat byte buffer, described by JSON-safe entries.

A dense entry holds elements ``[start, start + count)`` of a tensor (a tensor larger than the
space left in a bucket continues in the next one); a sparse entry holds ``count`` new values,
a steps entry how many representable steps each value moved (one signed byte each), and both
where they go (delta mode): the first flat index, then the gaps between successive ones in the
narrowest integer type that holds them. Every entry names the tensor's full shape and dtype, so
the engine checks each one against what was declared at the handshake.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..checkpoint.files import dtype_name, dtype_of

ALIGN = 64  # every entry's data starts at a multiple of this many bytes


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class Bucket:
    """One staging buffer being filled: its bytes and the entries in it."""

    data: torch.Tensor  # uint8
    index: int  # which of the transport's buffers
    used: int = 0
    entries: list[dict] = field(default_factory=list)

    def space(self) -> int:
        return self.data.numel() - _aligned(self.used)

    def take(self, nbytes: int) -> int:
        """Reserve ``nbytes`` (aligned) and return their offset."""
        offset = _aligned(self.used)
        self.used = offset + nbytes
        return offset


class Packer:
    """Packs dense tensors (from the segments they lie in, cast on the way) and sparse patches
    into buckets; ``ship(bucket)`` takes each full bucket, ``acquire()`` hands out an empty one
    (waiting for one to come back when all are in flight). ``flush()`` ships the last one."""

    def __init__(self, acquire: Callable[[], Bucket], ship: Callable[[Bucket], None]):
        self.acquire, self.ship = acquire, ship
        self.bucket: Bucket | None = None

    def _room(self, need: int) -> Bucket:
        """A bucket with at least ``need`` bytes free (``need`` <= a bucket's size)."""
        if self.bucket is not None and self.bucket.space() < need:
            self.flush()
        if self.bucket is None:
            self.bucket = self.acquire()
            if self.bucket.space() < need:
                raise ValueError(f"a bucket of {self.bucket.data.numel()} bytes cannot hold {need}")
        return self.bucket

    def dense(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], segments: list[tuple[int, torch.Tensor]]) -> None:
        """Elements of tensor ``name`` given as ``(start, flat tensor)`` segments (together the
        whole tensor, or the rows one rank sends), written in ``dtype``, split across buckets."""
        item = dtype.itemsize
        for start, seg in segments:
            done = 0
            while done < seg.numel():
                bucket = self._room(item)
                last = bucket.entries[-1] if bucket.entries else None
                follows = (  # the rest of the piece just written: extend it, no padding
                    last is not None and last["name"] == name and last["kind"] == "dense"
                    and last["start"] + last["count"] == start + done
                    and last["offset"] + last["count"] * item == bucket.used
                )
                free = bucket.data.numel() - bucket.used if follows else bucket.space()
                n = min(seg.numel() - done, free // item)
                if n == 0:
                    self.flush()
                    continue
                offset = bucket.used if follows else bucket.take(0)
                bucket.used = offset + n * item
                bucket.data[offset : offset + n * item].view(dtype).copy_(seg[done : done + n])
                if follows:
                    last["count"] += n
                else:
                    bucket.entries.append(_dense(name, dtype, shape, start + done, n, offset))
                done += n

    def sparse(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], indices: torch.Tensor, values: torch.Tensor, steps: bool = False) -> None:
        """A patch at increasing flat ``indices`` of tensor ``name``: new ``values``, or with
        ``steps`` how many representable steps each value moved (int8), split across buckets.
        Each piece stores its first index and the gaps to the next ones in the narrowest
        integer type that holds them (one byte where changes are dense)."""
        indices = indices.long()
        gaps = indices[1:] - indices[:-1]
        widest = int(gaps.max()) if gaps.numel() else 0
        gap_dtype = torch.uint8 if widest < 256 else torch.int16 if widest < 2**15 else torch.int32
        per, done = gap_dtype.itemsize + values.element_size(), 0
        while done < indices.numel():
            bucket = self._room(2 * ALIGN + per)
            n = min(indices.numel() - done, (bucket.space() - 2 * ALIGN) // per)
            at_g = bucket.take((n - 1) * gap_dtype.itemsize)
            bucket.data[at_g : at_g + (n - 1) * gap_dtype.itemsize].view(gap_dtype).copy_(gaps[done : done + n - 1])
            at_v = bucket.take(n * values.element_size())
            bucket.data[at_v : at_v + n * values.element_size()].view(values.dtype).copy_(values[done : done + n])
            bucket.entries.append(
                {"name": name, "dtype": dtype_name(dtype), "shape": list(shape), "kind": "steps" if steps else "sparse",
                 "count": n, "offset": at_v, "first": int(indices[done]), "gap_dtype": dtype_name(gap_dtype),
                 "gap_offset": at_g}
            )
            done += n

    def flush(self) -> None:
        if self.bucket is not None and self.bucket.entries:
            self.ship(self.bucket)
            self.bucket = None


def _dense(name: str, dtype: torch.dtype, shape: tuple[int, ...], start: int, count: int, offset: int) -> dict:
    return {"name": name, "dtype": dtype_name(dtype), "shape": list(shape), "kind": "dense",
            "start": start, "count": count, "offset": offset}


@dataclass
class Piece:
    """One decoded entry: a view into the received bytes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    values: torch.Tensor  # flat, ``count`` elements
    start: int = 0  # dense: the first element's flat index
    indices: torch.Tensor | None = None  # sparse: flat indices
    steps: bool = False  # ``values`` are how many representable steps each value moved (int8)

    @property
    def whole(self) -> bool:
        return self.indices is None and self.start == 0 and self.values.numel() == math.prod(self.shape)


def decode(data: torch.Tensor, entries: list[dict]) -> list[Piece]:
    """The pieces of one bucket, as views of ``data`` (uint8); malformed entries raise."""
    out = []
    for e in entries:
        dtype, shape, count = dtype_of(e["dtype"]), tuple(e["shape"]), int(e["count"])
        values = _view(data, int(e["offset"]), count, torch.int8 if e["kind"] == "steps" else dtype, e["name"])
        if e["kind"] == "dense":
            start = int(e["start"])
            if start < 0 or start + count > math.prod(shape):
                raise ValueError(f"piece [{start}, {start + count}) of '{e['name']}' lies outside its shape {shape}")
            out.append(Piece(e["name"], dtype, shape, values, start))
        elif e["kind"] in ("sparse", "steps"):
            gaps = _view(data, int(e["gap_offset"]), count - 1, dtype_of(e["gap_dtype"]), e["name"])
            indices = torch.empty(count, dtype=torch.int64)
            if count:
                indices[0] = int(e["first"])
                torch.cumsum(gaps.long(), 0, out=indices[1:])
                indices[1:] += indices[0]
            if count and (indices[0] < 0 or indices[-1] >= math.prod(shape) or (gaps.long() <= 0).any()):
                raise ValueError(f"patch of '{e['name']}' has indices outside its shape {shape} or out of order")
            out.append(Piece(e["name"], dtype, shape, values, indices=indices, steps=e["kind"] == "steps"))
        else:
            raise ValueError(f"unknown entry kind {e['kind']!r} for '{e['name']}'")
    return out


def _view(data: torch.Tensor, offset: int, count: int, dtype: torch.dtype, name: str) -> torch.Tensor:
    end = offset + count * dtype.itemsize
    if offset < 0 or end > data.numel() or offset % dtype.itemsize:
        raise ValueError(f"entry of '{name}' at bytes [{offset}, {end}) lies outside the {data.numel()}-byte bucket")
    return data[offset:end].view(dtype)
