"""safetensors files: a streaming writer that checksums what it writes, file checksums, and
reading a range of rows of a stored tensor.

The writer lays the standard format out itself (an 8-byte little-endian header length, a JSON
header padded with spaces to a multiple of 8, then the tensors' bytes back to back), so that a
tensor's bytes may arrive in pieces: conversion never holds more than one piece in memory, and
a save writes straight from the shards with no serialised copy.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

# torch dtype <-> the safetensors header's dtype string
_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_CHUNK = 8 << 20  # bytes read at a time when checksumming or copying a file


def dtype_name(dtype: torch.dtype) -> str:
    """The name the index records for a dtype (``"float32"``)."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors code of a dtype (``"F32"``)."""
    if dtype not in _CODES:
        raise ValueError(f"safetensors cannot store dtype {dtype}")
    return _CODES[dtype]


@dataclass(frozen=True)
class Entry:
    """One tensor of a file to write; ``parts()`` yields its bytes in order, as CPU tensors or
    as bytes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    parts: Callable[[], Iterable[torch.Tensor | bytes]]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def whole(name: str, tensor: torch.Tensor) -> Entry:
    """An entry whose bytes are one tensor's, written as they are (no copy when contiguous)."""
    return Entry(name, tensor.dtype, tuple(tensor.shape), lambda: (tensor,))


def write(
    path: Path, entries: list[Entry], metadata: dict[str, str] | None = None
) -> tuple[int, str]:
    """Write a safetensors file and fsync it; return its size in bytes and its CRC-32 (hex).

    Tensors are laid out widest dtype first (as safetensors' own writer does), which keeps
    every tensor aligned to its element size, and in the given order within a width: parts
    are asked for in that order (a Hugging Face export gathers one unit at a time by it).
    """
    entries = sorted(entries, key=lambda e: -e.dtype.itemsize)
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for e in entries:
        header[e.name] = {
            "dtype": dtype_code(e.dtype),
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    crc = 0
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(raw)), raw):
            f.write(chunk)
            crc = zlib.crc32(chunk, crc)
        for e in entries:
            written = 0
            for part in e.parts():
                view = part if isinstance(part, bytes) else _bytes(part)
                f.write(view)
                crc = zlib.crc32(view, crc)
                written += len(view)
            if written != e.nbytes:
                raise AssertionError(
                    f"'{e.name}': its parts gave {written} bytes, its shape needs {e.nbytes}"
                )
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(raw) + offset, f"{crc:08x}"


def _bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor, without a copy when it is contiguous."""
    if t.device.type != "cpu":
        raise AssertionError(f"writer got a tensor on {t.device}; parts must be in host memory")
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def checksum(path: Path) -> tuple[int, str]:
    """Size in bytes and CRC-32 (hex) of a file on disk, read in fixed-size chunks."""
    crc, size = 0, 0
    buf = bytearray(_CHUNK)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            view = memoryview(buf)[:n]
            crc = zlib.crc32(view, crc)
            size += n
    return size, f"{crc:08x}"


def header(path: Path) -> tuple[int, dict]:
    """Where a safetensors file's data starts, and its header (name -> dtype, shape, offsets)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def byte_range(fd: int, start: int, stop: int) -> Iterable[bytes]:
    """Bytes ``[start, stop)`` of an open file, in chunks of bounded size (no mapping)."""
    while start < stop:
        chunk = os.pread(fd, min(_CHUNK, stop - start), start)
        if not chunk:
            raise OSError(f"file ends at byte {start}, before {stop}")
        yield chunk
        start += len(chunk)


def read_rows(
    handle, name: str, shape: tuple[int, ...], first: int, lo: int, hi: int
) -> torch.Tensor:
    """Rows ``[lo, hi)`` of the full tensor, from a stored piece ``name`` that holds its rows
    from ``first`` on, shaped ``(hi - lo, *shape[1:])``; only those rows are read (a 0-dim
    tensor counts as one row)."""
    part = handle.get_slice(name)
    t = part[...] if not shape else part[lo - first : hi - first]
    return t.reshape(hi - lo, *shape[1:])
