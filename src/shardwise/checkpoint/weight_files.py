"""Hugging Face's layout of a model in safetensors files: how tensors split into files of at
most a size, the files' names, and the weight map (``model.safetensors.index.json``) that says
which file holds each tensor. ``convert`` and ``save_pretrained`` both write it.
"""

from __future__ import annotations

import json
from pathlib import Path

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def split_files(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Consecutive tensors (by their sizes in bytes) grouped into files of at most
    ``max_bytes`` each (a larger tensor gets a file of its own); the indices per file."""
    groups: list[list[int]] = [[]]
    size = 0
    for i, n in enumerate(sizes):
        if groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


def file_names(n: int) -> list[str]:
    """Hugging Face's names for a model in ``n`` safetensors files."""
    return [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_weight_map(out: Path, names: list[str], shards: list[list]) -> list[Path]:
    """For more than one file, ``model.safetensors.index.json``: which file holds each tensor
    (items with ``name``, ``dtype`` and ``shape``); the paths written."""
    if len(names) == 1:
        return []
    weight_map = {t.name: name for name, shard in zip(names, shards) for t in shard}
    total = sum(nbytes(t) for shard in shards for t in shard)
    (out / INDEX).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return [out / INDEX]


def nbytes(t) -> int:
    """Bytes of a tensor as stored (anything with a ``dtype`` and a ``shape``)."""
    n = t.dtype.itemsize
    for d in t.shape:
        n *= d
    return n
