"""Crash safety: how a checkpoint becomes visible only once it is complete.

Every rank writes into one temporary sibling directory ``<path>.tmp-<token>``; then rank 0
writes the index, then the commit marker (both fsynced), fsyncs the directory and renames it
to ``<path>`` (``os.replace``, atomic on POSIX), and fsyncs the parent. A process killed at any
moment leaves either no directory under the final name or a complete one; ``latest()`` skips
temporary directories and anything without a marker that matches its index.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from .index import INDEX, MARKER, Index, crc32, read_marker

_TEMP = ".tmp-"
_OLD = ".old-"


def temp_dir(path: Path, token: str) -> Path:
    return path.with_name(f"{path.name}{_TEMP}{token}")


def _write_synced(path: Path, raw: bytes) -> None:
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_index(tmp: Path, index: Index) -> str:
    """Write the index into the temporary directory; return its CRC-32 for the marker."""
    raw = index.to_bytes()
    _write_synced(tmp / INDEX, raw)
    return crc32(raw)


def write_marker(tmp: Path, index_crc: str) -> None:
    """The commit marker: written after everything else, it vouches for the index."""
    _write_synced(
        tmp / MARKER,
        json.dumps({"index_crc32": index_crc, "committed_ns": time.time_ns()}).encode(),
    )


def publish(tmp: Path, path: Path) -> None:
    """Rename the finished temporary directory to its final name, atomically.

    An existing checkpoint at ``path`` is first moved aside to ``<path>.old-<token>`` (still a
    complete checkpoint that ``latest()`` finds, should the process die before the second
    rename) and removed once the new one is in place.
    """
    _fsync_dir(tmp)
    old = None
    if path.exists():
        old = path.with_name(f"{path.name}{_OLD}{tmp.name.rsplit(_TEMP, 1)[1]}")
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def discard(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def committed_ns(path: Path) -> int | None:
    """When ``path`` was committed (ns since the epoch), or None if it is not a complete
    checkpoint: no marker, or one that does not match its index."""
    marker = read_marker(path)
    if marker is None:
        return None
    try:
        raw = (path / INDEX).read_bytes()
    except OSError:
        return None
    return marker.get("committed_ns", 0) if crc32(raw) == marker.get("index_crc32") else None


def is_complete(path: Path) -> bool:
    return committed_ns(path) is not None


def latest(root: str | os.PathLike) -> Path | None:
    """The most recently committed complete checkpoint directly under ``root``, or None.

    Temporary directories of unfinished saves and directories without a matching commit
    marker are ignored, so a save killed at any moment is never picked.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    found = []
    for child in root.iterdir():
        if _TEMP not in child.name and child.is_dir() and (ns := committed_ns(child)) is not None:
            found.append((ns, child))
    return max(found)[1] if found else None
