"""``save(..., format="dcp")``: a torch.distributed.checkpoint directory that FSDP2 loads
with ``dcp.load`` and ``set_state_dict`` at any world size.

The keys are those of FSDP2's ``{"model": model_sd, "optimizer": optim_sd}`` (dcp.py). Every
rank writes the rows it would write in shardwise's own format (state.py: its share of each
parameter and optimizer state tensor, once per row under hybrid sharding; rank 0 the buffers,
scalars and param groups; an owned parameter's owner all of it), as chunks, in parallel,
through DCP's own file writer. The write goes to a temporary directory that rank 0 renames to
``path`` once DCP has committed its metadata, so a crash leaves no partial checkpoint there.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
import torch.nn as nn
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from ..core import collectives as C
from . import commit, dcp
from .handle import SaveHandle
from .index import CheckpointError, is_dcp
from .state import (
    idle_world_runtime,
    is_per_element,
    optimizer_names,
    optimizers,
    param_slots,
    per_element_keys,
    persistent_buffers,
)


class Pieces(DefaultSavePlanner):
    """Writes exactly the given pieces: DCP's planner validates that they tile every tensor
    and builds the metadata; its writer writes them."""

    def __init__(self, items: list[WriteItem], objects: dict[MetadataIndex, Any]):
        super().__init__(flatten_state_dict=False)
        self._items, self._objects = items, objects

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self._items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self._objects[index]
        return obj() if callable(obj) else obj  # a piece read from a file when written


class Collect:
    def __init__(self) -> None:
        self.items: list[WriteItem] = []
        self.objects: dict[MetadataIndex, Any] = {}

    def rows(self, key: str, shape: tuple[int, ...], lo: int, piece: torch.Tensor) -> None:
        """Rows ``[lo, lo + len(piece))`` of tensor ``key`` of global ``shape``."""
        piece = piece.detach()
        if piece.device.type != "cpu":
            piece = piece.to("cpu")
        self.later(key, shape, lo, piece.shape, piece.dtype, piece)

    def later(self, key, shape, lo, rows_shape, dtype, piece: torch.Tensor | Callable) -> None:
        """Like ``rows``; ``piece`` may be a function that reads it when it is written."""
        offsets = torch.Size((lo, *[0] * (len(shape) - 1)) if shape else ())
        index = MetadataIndex(key, offsets)
        self.items.append(
            WriteItem(
                index=index,
                type=WriteItemType.SHARD if shape else WriteItemType.TENSOR,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets, torch.Size(rows_shape)),
                    properties=TensorProperties(dtype=dtype),
                    size=torch.Size(shape),
                ),
            )
        )
        self.objects[index] = piece

    def value(self, key: str, value: Any) -> None:
        index = MetadataIndex(key)
        self.items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
        self.objects[index] = value


def save(path: Path, model: nn.Module, optimizer, step: int | None, extra: Any) -> SaveHandle:
    """See ``shardwise.save``: ``format="dcp"`` (collective, synchronous)."""
    rt = idle_world_runtime(model, "save")
    group = rt.mesh.whole
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    problem, pieces = "", Collect()
    try:
        _collect(pieces, model, rt, optimizer, rank)
        if rank == 0:
            try:
                json.dumps(extra)
            except (TypeError, ValueError) as e:
                raise CheckpointError(f"extra must be JSON-serialisable: {e}") from e
            if step is not None and not isinstance(step, int):
                raise CheckpointError(f"step must be an int or None, got {step!r}")
            if path.exists() and not (is_dcp(path) or commit.is_complete(path)):
                raise CheckpointError(
                    f"{path} exists and is not a checkpoint: refusing to replace it"
                )
            saved = {
                "step": step,
                "extra": extra,
                "world_size": world,
                "strategy": rt.sharding.value,
                # the class, which the DCP keys do not say: convert(to="shardwise") needs it
                "optimizer": next((type(o).__name__ for o in optimizers(optimizer)), None),
            }
            pieces.value(dcp.SHARDWISE, json.dumps(saved))
    except Exception as e:  # must reach the other ranks, or they would wait for this one
        problem = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    answers: list = [None] * world
    C.blocking(
        "all_gather",
        "DCP save agreement",
        dist.all_gather_object,
        answers,
        (problem, uuid.uuid4().hex[:12]),
        group=group,
    )
    problems = [f"rank {r}: {p}" for r, (p, _) in enumerate(answers) if p]
    if problems:
        raise CheckpointError(
            f"save to {path} refused, nothing was written: " + "; ".join(problems)
        )
    tmp = commit.temp_dir(path, answers[0][1])
    problem = ""
    try:
        torch_dcp.save(
            {},
            storage_writer=FileSystemWriter(tmp, single_file_per_rank=True),
            planner=Pieces(pieces.items, pieces.objects),
            process_group=group,
        )
    except Exception as e:  # DCP gathers every rank's error and raises on all of them
        problem = f"{type(e).__name__}: {e}"
    if rank == 0 and not problem:
        try:
            commit.publish(tmp, path)
        except OSError as e:
            problem = f"renaming {tmp} to {path} failed: {e}"
    if rank == 0 and problem:
        commit.discard(tmp)
    C.agree(
        problem, "DCP save outcome",
        lambda m: CheckpointError(f"save to {path} failed, nothing was committed: {m}"), group=group,
    )
    return SaveHandle(path)


def _collect(pieces: Collect, model, rt, optimizer, rank: int) -> None:
    slots = param_slots(rt)
    for s in slots:
        lo, hi = s.saved
        if hi > lo:
            rows = s.rows_view(s.tensor)[lo - s.held[0] : hi - s.held[0]]
            for name in (s.name, *s.aliases):  # FSDP2's state dict holds every tied name
                pieces.rows(dcp.MODEL + name, s.shape, lo, rows if s.shape else rows.reshape(()))
    if rank == 0:
        for name, b in persistent_buffers(model).items():
            pieces.rows(dcp.MODEL + name, tuple(b.shape), 0, b)
    opts = optimizers(optimizer)
    if len(opts) > 1:
        raise CheckpointError("format='dcp' saves one optimizer, as FSDP2's state dict holds one")
    for opt in opts:
        _collect_optimizer(pieces, opt, slots, rank)


def _collect_optimizer(pieces: Collect, opt, slots, rank: int) -> None:
    by_id = {id(s.tensor): s for s in slots}
    keys = per_element_keys(opt)
    for p, st in opt.state.items():
        s = by_id.get(id(p))
        if s is None:
            raise CheckpointError(
                f"{type(opt).__name__} has state for a tensor that is not a parameter of the model"
            )
        for key, v in st.items():
            name = f"{dcp.OPTIMIZER}state.{s.name}.{key}"
            if is_per_element(p, key, v, keys):
                lo, hi = s.saved
                if hi > lo:
                    rows = s.rows_view(v)[lo - s.held[0] : hi - s.held[0]]
                    pieces.rows(name, s.shape, lo, rows if s.shape else rows.reshape(()))
            elif torch.is_tensor(v) and v.dim() == 0:
                if s.writes_whole:
                    pieces.rows(name, (), 0, v)
            elif v is None or isinstance(v, (bool, int, float)):
                if s.writes_whole:
                    pieces.value(name, v)
            else:
                raise CheckpointError(
                    f"optimizer state '{key}' of parameter '{s.name}' is not a tensor shaped "
                    "like its parameter, a 0-dim tensor or a number: DCP export refuses it"
                )
    if rank == 0:
        named = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": names}
            for g, names in zip(opt.param_groups, optimizer_names(opt, slots))
        ]
        param_groups(pieces, named)


def param_groups(pieces: Collect, groups: list[dict]) -> None:
    """The param groups (``params``: the parameter names) in FSDP2's form, by index, and in
    torchtitan's flattened form, per parameter."""
    for gi, group in enumerate(groups):
        for k, v in group.items():
            pieces.value(f"{dcp.OPTIMIZER}param_groups.{gi}.{k}", v)
            if k != "params":
                for name in group["params"]:
                    pieces.value(f"{dcp.OPTIMIZER}param_groups.{name}.{k}", v)
