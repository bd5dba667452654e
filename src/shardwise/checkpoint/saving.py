"""``save``: every rank writes its own rows of every tensor; rank 0 commits the checkpoint.

1. Each rank takes a snapshot: its rows of every parameter and optimizer state tensor (see
   state.py; with hybrid sharding, only the first replica's ranks: the others hold the same
   rows), and its RNG states; rank 0 adds the buffers, the optimizer's scalar state, its
   param groups and ``extra``. The ranks agree (one all-gather) that every snapshot worked and
   on the temporary directory, so a problem on one rank stops all before anything is written.
2. Each rank writes its file into the temporary directory (commit.py), then reports its size,
   CRC-32 and rows to rank 0 (a gather); rank 0 merges the reports into the index, checks that
   the pieces of every tensor tile its rows, commits, and tells every rank the outcome (a
   broadcast): every rank returns or raises together; none waits forever.

With ``async_=True`` the snapshot copies to host memory and steps 2 run in a background
thread over a Gloo group of their own, so training goes on; the next save or load of the model
first waits for it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..core import collectives as C
from ..core import groups
from . import commit, files
from .handle import SaveHandle, finish_pending, saves_of
from .index import CheckpointError, Index, Piece, TensorRecord, rank_file, storable_hyper
from .state import (
    ParamSlot,
    idle_world_runtime,
    is_per_element,
    optimizer_names,
    optimizers,
    param_slots,
    per_element_keys,
    persistent_buffers,
)


@dataclass
class _Report:
    """What one rank tells rank 0 about its file (picklable: it goes through a gather)."""

    file: str
    records: list[TensorRecord] = field(default_factory=list)  # every tensor this rank knows
    pieces: list[tuple[str, int, int]] = field(
        default_factory=list
    )  # (name, start, stop) in its file
    rng: dict[str, str] = field(default_factory=dict)  # its own state: RNG, error feedback
    meta: dict | None = None  # rank 0: strategy, step, extra, optimizer
    values: dict = field(default_factory=dict)  # optimizer numbers of the parameters it writes whole
    written: dict | None = None  # {"bytes", "crc32"} once the file is on disk
    error: str = ""


@dataclass
class _Snapshot:
    report: _Report
    entries: list[files.Entry] = field(default_factory=list)


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    step: int | None = None,
    extra: Any = None,
    async_: bool = False,
    format: str = "shardwise",
) -> SaveHandle:
    """Write a checkpoint of a sharded model (and optimizer) to the directory ``path``.

    Collective: every rank calls it. Each rank writes only its own rows of every parameter and
    optimizer state tensor (rank 0 also the buffers) into one safetensors file, under the
    parameters' original names, plus its RNG states; rank 0 writes the index and commits.
    With hybrid sharding the ranks of rank 0's shard group write the rows, once; the other
    replicas' files hold only their RNG states. The directory appears under ``path`` only once
    complete (an existing one is replaced), so a crash at any moment leaves the previous
    checkpoints loadable. Error feedback residuals (``shardwise.Comm``) are saved per rank
    with its RNG states, and restored with them. ``step`` and ``extra`` (any
    JSON value, e.g. a data position; rank 0's is kept) come back from ``load()``.
    ``optimizer`` may be a list (e.g. Muon on the owned matrices and AdamW on the rest).

    async_: copy the snapshot to host memory and write it in a background thread while
    training continues; the returned handle's ``wait()`` blocks until it is committed. A later
    save or load of the model waits for it first.

    format: ``"shardwise"`` (this format, the default) or ``"dcp"``: a
    torch.distributed.checkpoint directory as FSDP2 writes ``{"model": ..., "optimizer": ...}``
    (one optimizer), which FSDP2's ``dcp.load`` and ``set_state_dict`` read at any world size
    and ``load`` reads back; every rank writes its rows in parallel. It holds no RNG states
    and is written synchronously.
    """
    rt = idle_world_runtime(model, "save")
    finish_pending(model)
    if format == "dcp":
        if async_:
            raise CheckpointError("format='dcp' saves synchronously: drop async_=True")
        from . import dcp_saving  # it builds on this module

        return dcp_saving.save(Path(path), model, optimizer, step, extra)
    if format != "shardwise":
        raise CheckpointError(f"format must be 'shardwise' or 'dcp', not {format!r}")
    group = rt.mesh.whole
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    path = Path(path)
    problem, snap = "", None
    try:
        snap = _snapshot(model, rt, optimizer, path, rank, world, step, extra, copy=async_)
    except Exception as e:  # must reach the other ranks, or they would wait for this one
        problem = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    answers: list = [None] * world
    C.blocking(
        "all_gather", "checkpoint save agreement", dist.all_gather_object,
        answers, (problem, uuid.uuid4().hex[:12]), group=group,
    )
    problems = [f"rank {r}: {p}" for r, (p, _) in enumerate(answers) if p]
    if problems:
        raise CheckpointError(
            f"save to {path} refused, nothing was written: " + "; ".join(problems)
        )
    tmp = commit.temp_dir(path, answers[0][1])
    handle = SaveHandle(path)
    if not async_:
        _write_and_commit(snap, tmp, path, group)
        return handle
    saves = saves_of(model)
    if saves.group is None:  # collective, on the main thread of every rank alike
        saves.group = groups.background_group()
    handle.start(functools.partial(_write_and_commit, snap, tmp, path, saves.group))
    saves.pending = handle
    return handle


def _snapshot(
    model, rt, optimizer, path: Path, rank: int, world: int, step, extra, *, copy: bool
) -> _Snapshot:
    snap = _Snapshot(_Report(rank_file(rank, world)))
    rep = snap.report

    def take(t: torch.Tensor) -> torch.Tensor:
        # a host copy when the write runs later or the tensor is not in host memory
        return t.detach().to("cpu", copy=True) if copy or t.device.type != "cpu" else t.detach()

    def add(rec: TensorRecord, slot: ParamSlot | None, t: torch.Tensor, whole: bool | None = None) -> None:
        rep.records.append(rec)
        if slot is None:  # buffers and scalars: whole, from rank 0 (or as ``whole`` says)
            if (rank == 0) if whole is None else whole:
                snap.entries.append(files.whole(rec.name, take(t)))
                rep.pieces.append((rec.name, 0, rec.rows))
            return
        lo, hi = slot.saved
        if hi > lo:
            rows = slot.rows_view(t)[lo - slot.held[0] : hi - slot.held[0]]
            snap.entries.append(
                files.whole(rec.name, take(rows if slot.shape else rows.reshape(())))
            )
            rep.pieces.append((rec.name, lo, hi))

    slots = param_slots(rt)
    for s in slots:
        add(TensorRecord(s.name, "param", s.tensor.dtype, s.shape, s.aliases), s, s.tensor)
    for name, b in persistent_buffers(model).items():
        add(TensorRecord(name, "buffer", b.dtype, tuple(b.shape)), None, b)
    opt_meta = None
    if optimizer is not None:
        opt_meta = []
        for opt in optimizers(optimizer):
            rep.values.update(_optimizer_state(opt, slots, add))
            hyper = _param_groups(opt, optimizer_names(opt, slots))
            opt_meta.append({"class": type(opt).__name__, "param_groups": hyper})
    rep.rng["cpu"] = "rng.cpu"
    snap.entries.append(files.whole("rng.cpu", torch.get_rng_state()))
    if torch.cuda.is_available():
        rep.rng["cuda"] = "rng.cuda"
        snap.entries.append(files.whole("rng.cuda", torch.cuda.get_rng_state()))
    for i, unit in enumerate(rt.units):  # error feedback: this rank's own, as its RNG is
        for kind, residual in unit.residuals.items():
            rep.rng[f"residual.{i}.{kind}"] = f"residual.{i}.{kind}"
            snap.entries.append(files.whole(f"residual.{i}.{kind}", take(residual)))
    if rank == 0:
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"extra must be JSON-serialisable (it is stored in the index): {e}"
            ) from e
        if step is not None and not isinstance(step, int):
            raise CheckpointError(f"step must be an int or None, got {step!r}")
        if path.exists() and not commit.is_complete(path):
            raise CheckpointError(f"{path} exists and is not a checkpoint: refusing to replace it")
        rep.meta = {"strategy": rt.sharding.value, "step": step, "extra": extra, "optimizer": opt_meta}
    return snap


def _optimizer_state(optimizer, slots: list[ParamSlot], add) -> dict[str, dict]:
    """Add the optimizer's state tensors; return its plain-number state by parameter name."""
    by_id = {id(s.tensor): s for s in slots}
    keys = per_element_keys(optimizer)
    values: dict[str, dict] = {}
    for p, st in optimizer.state.items():
        s = by_id.get(id(p))
        if s is None:
            raise CheckpointError(
                f"{type(optimizer).__name__} has state for a tensor that is not a parameter "
                "of the model"
            )
        for key, v in st.items():
            name = f"optim.{s.name}.{key}"
            if is_per_element(p, key, v, keys):
                add(TensorRecord(name, "optim", v.dtype, s.shape, param=s.name, key=key), s, v)
            elif torch.is_tensor(v) and v.dim() == 0:
                add(TensorRecord(name, "optim_scalar", v.dtype, (), param=s.name, key=key), None, v, s.writes_whole)
            elif v is None or isinstance(v, (bool, int, float)):
                if s.writes_whole:
                    values.setdefault(s.name, {})[key] = v
            else:
                what = (
                    f"a tensor of shape {tuple(v.shape)}"
                    if torch.is_tensor(v)
                    else f"a {type(v).__name__}"
                )
                raise CheckpointError(
                    f"optimizer state '{key}' of parameter '{s.name}' is {what}: a checkpoint "
                    "stores state tensors shaped like their parameter, 0-dim tensors and numbers"
                )
    return values


def _param_groups(optimizer, names: list[list[str]]) -> list[dict]:
    return [
        {**storable_hyper(g, f"param group {gi}"), "params": group_names}
        for gi, (g, group_names) in enumerate(zip(optimizer.param_groups, names))
    ]


def _write_rank_file(snap: _Snapshot, tmp: Path) -> dict:
    """Write this rank's safetensors file; return its size and CRC-32 for the index."""
    size, crc = files.write(tmp / snap.report.file, snap.entries, metadata={"format": "pt"})
    return {"bytes": size, "crc32": crc}


def _write_and_commit(snap: _Snapshot, tmp: Path, path: Path, group) -> None:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    report = snap.report
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        report.written = _write_rank_file(snap, tmp)
    except Exception as e:
        report.error = f"writing {report.file} failed: {type(e).__name__}: {e}"
    snap.entries = []  # drop the host copies now
    try:
        reports = [None] * world if rank == 0 else None
        C.blocking("gather", "checkpoint save reports", dist.gather_object, report, reports, dst=0, group=group)
        problem = _commit(reports, tmp, path) if rank == 0 else ""
        C.agree(
            problem, "checkpoint save outcome",
            lambda m: CheckpointError(f"save to {path} failed, nothing was committed: {m}"), group=group,
        )
    except CheckpointError:
        raise
    except RuntimeError as e:  # a rank died or stalled: the collective timed out
        raise CheckpointError(
            f"save to {path} did not complete: another rank failed or died during it ({e}). "
            f"Nothing was committed; the previous checkpoints are untouched and {tmp} is not one."
        ) from e


def _commit(reports: list[_Report], tmp: Path, path: Path) -> str:
    """Rank 0: merge the reports into the index and commit; return "" or what went wrong."""
    errors = [f"rank {r}: {rep.error}" for r, rep in enumerate(reports) if rep.error]
    try:
        if errors:
            raise CheckpointError("; ".join(errors))
        index = _merge(reports)
        crc = commit.write_index(tmp, index)
        commit.write_marker(tmp, crc)
        commit.publish(tmp, path)
    except Exception as e:  # the other ranks wait for this outcome: always send one
        commit.discard(tmp)
        return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    return ""


def _merge(reports: list[_Report]) -> Index:
    tensors: dict[str, TensorRecord] = {}
    for r, rep in enumerate(reports):
        for rec in rep.records:
            have = tensors.setdefault(rec.name, dataclasses.replace(rec, pieces=[]))
            if (have.kind, have.dtype, have.shape) != (rec.kind, rec.dtype, rec.shape):
                raise CheckpointError(
                    f"ranks disagree on tensor '{rec.name}': rank {r} has a {rec.kind} of "
                    f"{rec.dtype} {rec.shape}, an earlier rank a {have.kind} of {have.dtype} "
                    f"{have.shape}"
                )
        for name, lo, hi in rep.pieces:
            tensors[name].pieces.append(Piece(rep.file, lo, hi))
    for rec in tensors.values():
        rec.pieces.sort(key=lambda p: p.start)
        starts, stops = [p.start for p in rec.pieces], [p.stop for p in rec.pieces]
        if starts != [0, *stops][:-1] or (stops[-1] if stops else 0) != rec.rows:
            pieces = [(p.file, p.start, p.stop) for p in rec.pieces]
            raise CheckpointError(
                f"tensor '{rec.name}': the ranks' files do not hold each of its {rec.rows} rows "
                f"once (pieces {pieces}); every rank must hold optimizer state for the same "
                "parameters"
            )
    meta = reports[0].meta
    optimizer = meta["optimizer"]
    if optimizer is not None:  # each optimizer's numbers, from the ranks that wrote them
        values = {k: v for rep in reports for k, v in rep.values.items()}
        for entry in optimizer:
            names = {n for g in entry["param_groups"] for n in g["params"]}
            entry["values"] = {k: v for k, v in values.items() if k in names}
        optimizer = optimizer[0] if len(optimizer) == 1 else optimizer
    return Index(
        world_size=len(reports),
        strategy=meta["strategy"],
        step=meta["step"],
        extra=meta["extra"],
        files={rep.file: rep.written for rep in reports},
        tensors=tensors,
        optimizer=optimizer,
        rng=[{"file": rep.file, **rep.rng} for rep in reports],
    )
