"""``convert``: a shardwise checkpoint to a standard safetensors model, offline.

No process group is needed, and memory stays bounded by one read chunk (8 MiB): the output
header is known up front from the index, and each tensor's bytes are copied from the ranks'
files, piece by piece in row order, with plain reads (no file is mapped into memory).
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path

import torch.nn as nn

from . import files
from .index import CheckpointError, TensorRecord, read_index, verified_headers
from .weight_files import file_names, nbytes, split_files, write_weight_map


def convert(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    max_shard_bytes: int = 5 * 2**30,
    to: str = "hf",
    model: nn.Module | None = None,
    optimizer: str | None = None,
) -> list[Path]:
    """Write the parameters and buffers of checkpoint ``ckpt`` into the directory ``out`` as a
    standard safetensors model under the original names and dtypes; return the files written.

    The layout is what Hugging Face loaders read: one ``model.safetensors`` when the tensors
    fit in ``max_shard_bytes``, else ``model-00001-of-0000N.safetensors`` files (each up to
    ``max_shard_bytes``, or one tensor if larger) and ``model.safetensors.index.json``. A tied
    parameter is stored once, under its first name. Every input file is checked against its
    CRC-32 first.

    ``to="dcp"`` writes instead the torch.distributed.checkpoint directory that
    ``save(format="dcp")`` would have written (model, optimizer, step and extra), which FSDP2
    loads at any world size; each saved piece is read only as DCP writes it.

    ``to="shardwise"`` reads ``ckpt`` as a DCP directory (FSDP2's, torchtitan's) and writes it
    in shardwise's own format. It needs the ``model`` the checkpoint belongs to (built on the
    meta device is enough), which tells parameters from buffers, and, where the saved
    hyper-parameters fit several torch.optim classes (Adam and AdamW do), the ``optimizer``'s
    class name.
    """
    ckpt, out = Path(ckpt), Path(out)
    if to not in ("hf", "dcp", "shardwise"):
        raise CheckpointError(f"to must be 'hf', 'dcp' or 'shardwise', not {to!r}")
    if to != "shardwise" and (model is not None or optimizer is not None):
        raise CheckpointError("model and optimizer apply to to='shardwise' only")
    if to == "shardwise":
        if model is None:
            raise CheckpointError(
                "to='shardwise' needs the model the checkpoint belongs to (it tells parameters "
                "from buffers): build it on the meta device"
            )
        from .native_conversion import from_dcp

        return from_dcp(ckpt, out, model, optimizer)
    if to == "dcp":
        from .dcp_conversion import to_dcp  # it builds on this module

        return to_dcp(ckpt, out)
    index = read_index(ckpt)
    headers = verified_headers(ckpt, index)
    tensors = [t for t in index.tensors.values() if t.kind in ("param", "buffer")]
    groups = split_files([nbytes(t) for t in tensors], max_shard_bytes)
    shards = [[tensors[i] for i in g] for g in groups]
    names = file_names(len(shards))
    out.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        fds = {}
        for f in index.files:
            fds[f] = os.open(ckpt / f, os.O_RDONLY)
            stack.callback(os.close, fds[f])
        for name, shard in zip(names, shards):
            entries = [
                files.Entry(t.name, t.dtype, t.shape, _bytes_of(t, fds, headers)) for t in shard
            ]
            files.write(out / name, entries, metadata={"format": "pt"})
    return [out / name for name in names] + write_weight_map(out, names, shards)


def _bytes_of(t: TensorRecord, fds: dict[str, int], headers: dict[str, tuple[int, dict]]):
    """The tensor's bytes: its pieces' byte ranges in the ranks' files, in row order."""

    def parts():
        for p in t.pieces:
            base, header = headers[p.file]
            entry = header.get(t.name)
            want = [p.stop - p.start, *t.shape[1:]] if t.shape else []
            if (
                entry is None
                or entry["shape"] != want
                or entry["dtype"] != files.dtype_code(t.dtype)
            ):
                raise CheckpointError(
                    f"file {p.file} does not hold '{t.name}' as the index says ({entry})"
                )
            start, stop = entry["data_offsets"]
            yield from files.byte_range(fds[p.file], base + start, base + stop)

    return parts
