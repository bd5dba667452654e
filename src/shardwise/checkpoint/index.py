"""The checkpoint directory: file names, the index (``index.json``) and the commit marker.

A checkpoint is a directory holding one safetensors file per rank that saved it (with hybrid
sharding, the files of all but the first replica hold only RNG states), the index,
and the marker ``COMMITTED`` (written last; it records the index's CRC-32). The index says,
for every tensor, its name, kind, dtype, global shape and which rows each file holds; for
every file its size and CRC-32; and the world size, strategy, step, optimizer groups, each
rank's RNG entries and the user's ``extra``. See docs/checkpoints.md.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from ..core.errors import ShardwiseError
from .files import checksum, dtype_name, dtype_of, header

FORMAT = "shardwise-checkpoint"
VERSION = 1
INDEX = "index.json"
MARKER = "COMMITTED"

# optim: optimizer state shaped like its parameter, split by rows; optim_scalar: 0-dim, stored once
Kind = Literal["param", "buffer", "optim", "optim_scalar"]


class CheckpointError(ShardwiseError):
    """A checkpoint cannot be written or read: the message names the tensor and the file."""


def rank_file(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of a tensor, stored in ``file`` under the tensor's name."""

    file: str
    start: int
    stop: int


@dataclass
class TensorRecord:
    """One tensor of the checkpoint: a parameter (under its first name; ``aliases`` are its
    other names), a buffer, or optimizer state ``key`` of parameter ``param``."""

    name: str
    kind: Kind
    dtype: torch.dtype
    shape: tuple[int, ...]
    aliases: tuple[str, ...] = ()
    param: str | None = None  # optimizer state: the parameter's name
    key: str | None = None  # optimizer state: its key (e.g. "exp_avg")
    pieces: list[Piece] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    def overlapping(self, lo: int, hi: int) -> list[Piece]:
        return [p for p in self.pieces if p.start < hi and p.stop > lo]

    def where(self) -> str:
        files = sorted({p.file for p in self.pieces})
        return f"file {files[0]}" if len(files) == 1 else f"files {', '.join(files)}"

    def to_json(self) -> dict:
        out: dict[str, Any] = {
            "kind": self.kind,
            "dtype": dtype_name(self.dtype),
            "shape": list(self.shape),
        }
        if self.aliases:
            out["aliases"] = list(self.aliases)
        if self.param is not None:
            out["param"], out["key"] = self.param, self.key
        out["pieces"] = [{"file": p.file, "rows": [p.start, p.stop]} for p in self.pieces]
        return out

    @staticmethod
    def from_json(name: str, d: dict) -> TensorRecord:
        return TensorRecord(
            name,
            d["kind"],
            dtype_of(d["dtype"]),
            tuple(d["shape"]),
            tuple(d.get("aliases", ())),
            d.get("param"),
            d.get("key"),
            [Piece(p["file"], *p["rows"]) for p in d["pieces"]],
        )


@dataclass
class Index:
    """Everything ``index.json`` holds (field by field in docs/checkpoints.md)."""

    world_size: int | None  # None (and strategy None, rng []): converted from FSDP2's DCP
    strategy: str | None
    step: int | None
    extra: Any
    files: dict[str, dict]  # file name -> {"bytes": size, "crc32": hex}
    tensors: dict[str, TensorRecord]
    # {"class", "param_groups": [{..., "params": [names]}], "values"}, or a list of them
    optimizer: dict | list[dict] | None
    # per saving rank, the entries of its own state in its file: {"file": name, "cpu": entry
    # [, "cuda": entry][, "residual.<unit>.<kind>": entry, ...]} (RNG states; error feedback)
    rng: list[dict[str, str]]

    def to_bytes(self) -> bytes:
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "world_size": self.world_size,
            "strategy": self.strategy,
            "step": self.step,
            "extra": self.extra,
            "files": self.files,
            "optimizer": self.optimizer,
            "rng": self.rng,
            "tensors": {n: t.to_json() for n, t in self.tensors.items()},
        }
        return json.dumps(doc, indent=1).encode()

    @staticmethod
    def from_bytes(raw: bytes) -> Index:
        d = json.loads(raw)
        if d.get("format") != FORMAT or d.get("version") != VERSION:
            raise ValueError(
                f"format {d.get('format')!r} version {d.get('version')!r}, "
                f"expected {FORMAT!r} {VERSION}"
            )
        return Index(
            d["world_size"],
            d["strategy"],
            d["step"],
            d["extra"],
            d["files"],
            {n: TensorRecord.from_json(n, t) for n, t in d["tensors"].items()},
            d["optimizer"],
            d["rng"],
        )


def crc32(raw: bytes) -> str:
    return f"{zlib.crc32(raw):08x}"


def read_marker(path: Path) -> dict | None:
    """The commit marker of a checkpoint directory, or None if it has none (or a broken one)."""
    try:
        return json.loads((path / MARKER).read_bytes())
    except (OSError, ValueError):
        return None


def is_dcp(path: Path) -> bool:
    """A torch.distributed.checkpoint directory (checkpoint/dcp.py), not one of ours."""
    return (path / ".metadata").is_file()


def read_index(path: Path) -> Index:
    """The index of a complete checkpoint; raises CheckpointError for anything else."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: not a directory")
    marker = read_marker(path)
    if marker is None:
        raise CheckpointError(
            f"{path} is not a complete checkpoint: it has no readable {MARKER} marker (its save "
            "was interrupted or is still running). Use shardwise.latest(root) to find the newest "
            "complete one."
        )
    try:
        raw = (path / INDEX).read_bytes()
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: cannot read {INDEX} ({e})") from e
    if crc32(raw) != marker.get("index_crc32"):
        raise CheckpointError(
            f"checkpoint {path}: {INDEX} does not match the CRC-32 its {MARKER} marker records "
            f"({crc32(raw)} != {marker.get('index_crc32')}); the index is corrupt"
        )
    try:
        return Index.from_bytes(raw)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path}: {INDEX} is not a shardwise index ({e})") from e


def storable_hyper(group: dict, where: str) -> dict:
    """A param group's hyper-parameters as the index stores them (JSON: tuples as lists),
    less its ``params``; a value JSON cannot hold is a named error (``where``: which group)."""
    hyper = {}
    for k, v in group.items():
        if k == "params":
            continue
        v = list(v) if isinstance(v, tuple) else v
        try:
            json.dumps(v)
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"{where}'s '{k}' is a {type(v).__name__}, which the index (JSON) cannot "
                "store: use a plain number"
            ) from e
        hyper[k] = v
    return hyper


def verified_headers(ckpt: Path, index: Index) -> dict[str, tuple[int, dict]]:
    """Each data file's safetensors header, once its size and CRC-32 match the index."""
    headers = {}
    for name, meta in index.files.items():
        path = ckpt / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {ckpt}: file {name} is missing")
        size, crc = checksum(path)
        if (size, crc) != (meta["bytes"], meta["crc32"]):
            raise CheckpointError(
                f"checkpoint {ckpt}: file {name} has {size} bytes and CRC-32 {crc}, the index "
                f"records {meta['bytes']} bytes and {meta['crc32']}: it is truncated or corrupt"
            )
        headers[name] = header(path)
    return headers
