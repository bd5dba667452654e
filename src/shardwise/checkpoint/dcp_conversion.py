"""``convert(ckpt, out, to="dcp")``: a shardwise checkpoint as a torch.distributed.checkpoint
directory, offline (no process group), in the layout ``save(format="dcp")`` writes.

Each saved piece (a rank's rows) becomes one DCP chunk, read from its file only when DCP's
writer asks for it, so memory stays bounded by one piece. The files' CRC-32s are checked first.
"""

from __future__ import annotations

import functools
import json
import uuid
import warnings
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed.checkpoint as torch_dcp
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemWriter

from . import commit, dcp, files
from .dcp_saving import Collect, Pieces, param_groups
from .index import CheckpointError, Piece, TensorRecord, read_index, verified_headers


def _piece(handle, t: TensorRecord, p: Piece) -> torch.Tensor:
    rows = files.read_rows(handle, t.name, t.shape, p.start, p.start, p.stop)
    return rows if t.shape else rows.reshape(())


def to_dcp(ckpt: Path, out: Path) -> list[Path]:
    """Write checkpoint ``ckpt`` as the DCP directory ``out``; return the files written."""
    index = read_index(ckpt)
    verified_headers(ckpt, index)
    saved = index.optimizer if isinstance(index.optimizer, list) else [index.optimizer]
    saved = [o for o in saved if o is not None]
    if len(saved) > 1:
        raise CheckpointError(
            f"{ckpt} holds {len(saved)} optimizers' state; a DCP checkpoint holds one"
        )
    if out.exists():
        raise CheckpointError(f"{out} exists: convert writes a new directory")
    pieces = Collect()
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(ckpt / f, framework="pt")) for f in index.files}
        for t in index.tensors.values():
            if t.kind in ("param", "buffer"):
                keys = [dcp.MODEL + n for n in (t.name, *t.aliases)]
            else:
                keys = [f"{dcp.OPTIMIZER}state.{t.param}.{t.key}"]
            for p in t.pieces:
                read = functools.partial(_piece, handles[p.file], t, p)
                rows = (p.stop - p.start, *t.shape[1:]) if t.shape else ()
                for key in keys:
                    pieces.later(key, t.shape, p.start, rows, t.dtype, read)
        for opt in saved:
            for pname, values in opt["values"].items():
                for k, v in values.items():
                    pieces.value(f"{dcp.OPTIMIZER}state.{pname}.{k}", v)
            param_groups(pieces, opt["param_groups"])
        meta = {
            "step": index.step,
            "extra": index.extra,
            "world_size": index.world_size,
            "strategy": index.strategy,
            "optimizer": saved[0]["class"] if saved else None,
        }
        pieces.value(dcp.SHARDWISE, json.dumps(meta))
        tmp = commit.temp_dir(out, uuid.uuid4().hex[:12])
        try:
            with warnings.catch_warnings():  # one process, on purpose: DCP warns it assumes so
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                torch_dcp.save(
                    {},
                    storage_writer=FileSystemWriter(tmp, single_file_per_rank=True),
                    planner=Pieces(pieces.items, pieces.objects),
                    no_dist=True,
                )
            commit.publish(tmp, out)
        finally:
            commit.discard(tmp)
    return sorted(out.iterdir())
