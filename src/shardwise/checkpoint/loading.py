"""``load`` (a shardwise checkpoint) and ``load_full`` (a standard safetensors model) into a
sharded model: each rank reads just the rows it owns now, whatever the world size, wrap or
strategy of the save, straight from the files (safetensors slices), so host memory stays
O(shard).

Both run in two phases. Planning reads only the index and the file headers, and checks
everything: names, shapes, dtypes, and (for checkpoints) the size and CRC-32 of each file this
rank will read. The ranks then agree (one all-gather) and, if any found a problem, all raise
before anything changed. Only then are the rows copied in.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import safe_open

from ..core.policies import Sharding
from . import pretrained
from .handle import finish_pending
from .index import CheckpointError, Index, Piece, TensorRecord, is_dcp, read_index
from .load_plan import CheckpointInfo, LoadPlan, agree_on_problems, listed
from .state import (
    ParamSlot,
    idle_world_runtime,
    optimizer_names,
    optimizers,
    param_slots,
    persistent_buffers,
)


def _located(names: list[str], records: dict[str, TensorRecord], limit: int = 10) -> str:
    shown = ", ".join(f"'{n}' ({records[n].where()})" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    names: Callable[[str], str] | None = None,
) -> CheckpointInfo:
    """Load a checkpoint written by ``save()`` into a sharded model (and optimizer).

    Collective. Works at any world size, wrap and strategy: tensors are matched by name and
    each rank reads only the rows it now owns, so host memory stays O(shard). Optimizer state
    is resharded the same way (pass the optimizers in the order they were saved, e.g. Muon's
    and AdamW's), and the param groups' hyper-parameters restored. Each rank's
    RNG states and error feedback residuals are restored when the world size is the one
    saved (residuals start from zero otherwise: they belong to the saved rows of each rank). Any mismatch (a missing or
    extra tensor, shape, dtype, a missing, truncated or corrupt file) raises CheckpointError
    on every rank, naming the tensor and the file, before anything is changed.

    A torch.distributed.checkpoint directory (``.metadata``, as FSDP2's ``dcp.save`` or
    torchtitan's ``step-N/`` writes it) loads too: the model and one optimizer (AdamW, SGD,
    ...), each rank reading the saved chunks that hold its rows; its metadata is unpickled by
    a restricted unpickler and its values with ``weights_only``. ``names`` maps the
    checkpoint's parameter names to the model's (renamed modules); DCP checkpoints only. RNG
    states are not in a DCP checkpoint (``rng_restored`` is False).
    """
    rt = idle_world_runtime(model, "load")
    finish_pending(model)
    path = Path(path)
    if is_dcp(path):
        from . import dcp_loading  # it builds on this module (and loads DCP only when used)

        return dcp_loading.load(path, model, optimizer, names)
    if names is not None:
        raise CheckpointError("names= applies to DCP checkpoints; shardwise's own match by name")
    group = rt.mesh.whole
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    index: Index | None = None
    with ExitStack() as stack:
        plan = LoadPlan(stack, path, None)
        restore: list[Callable[[], None]] = []
        try:
            index = read_index(path)
            plan.files_meta = index.files
            slots = param_slots(rt)
            params_match = _plan_params(plan, index, slots)
            _plan_buffers(plan, index, persistent_buffers(model))
            if (
                optimizer is not None and params_match
            ):  # else its every difference follows from theirs
                opts = optimizers(optimizer)
                saved = _saved_optimizers(index, len(opts))
                held = {n for o in opts for names in optimizer_names(o, slots) for n in names}
                for opt, entry in zip(opts, saved):
                    restore.append(_plan_optimizer(plan, index, opt, entry, slots, held))
            same = index.world_size == world and bool(index.rng)  # a converted DCP has none
            if same:
                restore.append(_plan_rng(plan, index.rng[rank]))
            restore.append(_plan_residuals(plan, index.rng[rank] if same else {}, rt))
        except Exception as e:  # any rank's failure must reach the others: see agree_on_problems
            plan.problem(str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}")
        agree_on_problems(plan, f"cannot load {path}", group)
        with torch.no_grad():
            for copy in plan.copies:
                copy()
        for r in restore:
            r()
    return CheckpointInfo(
        path,
        index.step,
        index.extra,
        index.world_size,
        Sharding.of(index.strategy) if index.strategy else None,
        index.world_size == world and bool(index.rng),
    )


def _plan_params(plan: LoadPlan, index: Index, slots: list[ParamSlot]) -> bool:
    """Plan the parameters' copies; return whether the names match."""
    stored = {n: r for n, r in index.tensors.items() if r.kind == "param"}
    match = _check_names(plan, "parameters", [s.name for s in slots], stored)
    for s in slots:
        rec = stored.get(s.name)
        if rec is None or not _check_record(plan, rec, s.shape, s.tensor.dtype):
            continue
        if set(rec.aliases) != set(s.aliases):
            plan.problem(
                f"parameter '{s.name}' is shared with {list(rec.aliases)} in the checkpoint "
                "but with "
                f"{list(s.aliases)} in the model"
            )
            continue
        lo, hi = s.held
        plan.rows(
            rec.name,
            rec.shape,
            rec.dtype,
            rec.overlapping(lo, hi),
            lo,
            hi,
            s.rows_view(s.tensor.detach()),
        )
    return match


def _plan_buffers(plan: LoadPlan, index: Index, buffers: dict[str, torch.Tensor]) -> None:
    stored = {n: r for n, r in index.tensors.items() if r.kind == "buffer"}
    _check_names(plan, "buffers", list(buffers), stored)
    for name, b in buffers.items():
        rec = stored.get(name)
        if rec is not None and _check_record(plan, rec, tuple(b.shape), b.dtype):
            plan.rows(
                name,
                rec.shape,
                rec.dtype,
                rec.pieces,
                0,
                rec.rows,
                b.detach().view(rec.rows, *rec.shape[1:]),
            )


def _check_names(
    plan: LoadPlan, what: str, expected: list[str], stored: dict[str, TensorRecord]
) -> bool:
    missing = [n for n in expected if n not in stored]
    unexpected = [n for n in stored if n not in set(expected)]
    if missing:
        plan.problem(f"{what} missing from the checkpoint: {listed(missing)}")
    if unexpected:
        plan.problem(
            f"{what} in the checkpoint that the model does not have: {_located(unexpected, stored)}"
        )
    return not missing and not unexpected


def _check_record(
    plan: LoadPlan, rec: TensorRecord, shape: tuple[int, ...], dtype: torch.dtype
) -> bool:
    if rec.shape != shape:
        plan.problem(
            f"tensor '{rec.name}' has shape {list(rec.shape)} in the checkpoint "
            f"({rec.where()}); the model needs {list(shape)}"
        )
        return False
    if rec.dtype != dtype:
        plan.problem(
            f"tensor '{rec.name}' is {rec.dtype} in the checkpoint ({rec.where()}); "
            f"the model needs {dtype}"
        )
        return False
    return True


def _saved_optimizers(index: Index, count: int) -> list[dict]:
    """The checkpoint's optimizer entries, as many as the optimizers being loaded."""
    saved = index.optimizer
    if saved is None:
        raise CheckpointError(
            "the checkpoint holds no optimizer state: pass optimizer=None to load the model alone"
        )
    saved = saved if isinstance(saved, list) else [saved]
    if len(saved) != count:
        classes = [e["class"] for e in saved]
        raise CheckpointError(
            f"the checkpoint holds the state of {len(saved)} optimizers ({', '.join(classes)}), "
            f"{count} were passed: pass the same optimizers, in the order they were saved"
        )
    return saved


def _plan_optimizer(
    plan: LoadPlan,
    index: Index,
    optimizer: torch.optim.Optimizer,
    saved: dict,
    slots: list[ParamSlot],
    held: set[str],
) -> Callable[[], None]:
    """Check the optimizer against its entry in the checkpoint; return what installs its
    state. ``held`` names the parameters of every optimizer being loaded."""
    cls = type(optimizer).__name__
    if saved["class"] != cls:
        raise CheckpointError(f"the checkpoint's optimizer is {saved['class']}, this one is {cls}")
    groups = optimizer_names(optimizer, slots)
    if len(groups) != len(saved["param_groups"]):
        raise CheckpointError(
            f"the checkpoint's {cls} has {len(saved['param_groups'])} param groups, "
            f"this one {len(groups)}"
        )
    for gi, (names, g) in enumerate(zip(groups, saved["param_groups"])):
        if set(names) != set(g["params"]):
            plan.problem(
                f"param group {gi} differs: only in the checkpoint "
                f"{listed(sorted(set(g['params']) - set(names)))}; "
                f"only in this optimizer {listed(sorted(set(names) - set(g['params'])))}"
            )
    by_name = {s.name: s for s in slots}
    group_of = {n: g for names, g in zip(groups, optimizer.param_groups) for n in names}
    state: dict[str, dict[str, Any]] = {}  # parameter name -> its new state (filled by the copies)
    records = {n: r for n, r in index.tensors.items() if r.kind in ("optim", "optim_scalar")}
    foreign = [n for n, r in records.items() if r.param not in held]
    if foreign:
        plan.problem(
            "optimizer state in the checkpoint for parameters this optimizer does not hold: "
            + _located(foreign, records)
        )
    for rec in records.values():
        if rec.param not in group_of or by_name[rec.param].elsewhere:  # its owner holds its state
            continue
        s = by_name[rec.param]
        if rec.kind == "optim":
            if rec.shape != s.shape:
                plan.problem(
                    f"optimizer state '{rec.name}' has shape {list(rec.shape)} "
                    f"({rec.where()}); its parameter has {list(s.shape)}"
                )
                continue
            dest = torch.empty(s.tensor.shape, dtype=rec.dtype, device=s.tensor.device)
            lo, hi = s.held
            plan.rows(
                rec.name, rec.shape, rec.dtype, rec.overlapping(lo, hi), lo, hi, s.rows_view(dest)
            )
        else:
            g = group_of[rec.param]
            # torch keeps a scalar like Adam's step on the host unless the step runs on the device
            device = (
                s.tensor.device if g.get("capturable") or g.get("fused") else torch.device("cpu")
            )
            dest = torch.empty((), dtype=rec.dtype, device=device)
            plan.rows(rec.name, (), rec.dtype, rec.pieces, 0, 1, dest.view(1))
        state.setdefault(rec.param, {})[rec.key] = dest
    for pname, values in saved["values"].items():
        if pname in group_of and not by_name[pname].elsewhere:
            state.setdefault(pname, {}).update(values)

    def install() -> None:
        optimizer.state.clear()
        for pname, st in state.items():
            optimizer.state[by_name[pname].tensor] = st
        for g, sg in zip(optimizer.param_groups, saved["param_groups"]):
            for k, v in sg.items():
                if k != "params":
                    g[k] = tuple(v) if isinstance(g.get(k), tuple) else v

    return install


def _plan_rng(plan: LoadPlan, entry: dict[str, str]) -> Callable[[], None]:
    """Read this rank's saved RNG states (the CUDA one only where CUDA is available)."""
    states: dict[str, torch.Tensor] = {}
    handle = plan.open(entry["file"])
    if handle is not None:
        for kind in ("cpu", "cuda"):
            if kind in entry and (kind == "cpu" or torch.cuda.is_available()):
                states[kind] = handle.get_tensor(entry[kind])

    def install() -> None:
        if "cpu" in states:
            torch.set_rng_state(states["cpu"])
        if "cuda" in states:
            torch.cuda.set_rng_state(states["cuda"])

    return install


def _plan_residuals(plan: LoadPlan, entry: dict[str, str], rt) -> Callable[[], None]:
    """Read this rank's saved error feedback residuals; installing replaces the model's
    (a unit without a saved one starts from zero)."""
    saved: dict[tuple[int, str], torch.Tensor] = {}
    keys = [k for k in entry if k.startswith("residual.")]
    handle = plan.open(entry["file"]) if keys else None
    if handle is not None:
        for key in keys:
            _, unit, kind = key.split(".", 2)
            saved[int(unit), kind] = handle.get_tensor(entry[key])

    def install() -> None:
        for i, unit in enumerate(rt.units):
            unit.residuals = {kind: t for (j, kind), t in saved.items() if j == i}

    return install


# --- standard safetensors models (single file or Hugging Face index)
def _standard_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file, for a .safetensors file, an index JSON, or a directory of either."""
    if path.is_dir():
        if (path / "model.safetensors.index.json").is_file():
            path = path / "model.safetensors.index.json"
        elif (path / "model.safetensors").is_file():
            path = path / "model.safetensors"
        else:
            raise CheckpointError(
                f"{path} holds neither model.safetensors nor model.safetensors.index.json"
            )
    if not path.is_file():
        raise CheckpointError(f"no safetensors model at {path}")
    if path.suffix == ".json":
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(
                f"{path} is not a safetensors index with a weight_map ({e})"
            ) from e
        return {name: path.parent / f for name, f in weight_map.items()}
    try:
        with safe_open(path, framework="pt") as f:
            return dict.fromkeys(f.keys(), path)
    except Exception as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e})") from e


def load_full(model: nn.Module, path: str | os.PathLike) -> None:
    """Fill a sharded model from a standard safetensors model: one ``model.safetensors`` or a
    Hugging Face style index (``model.safetensors.index.json``) and its files, or a directory
    holding either. Each rank reads only its rows of each parameter.

    Collective. Names are the unsharded model's state-dict names (a tied parameter may be
    stored under any of its names); values are cast to the parameters' dtypes, as
    ``load_full_state_dict`` does. A missing, extra or misshapen tensor raises on every rank
    before anything is changed.

    A transformers model (one with a ``config`` and a ``base_model_prefix``) loads as its
    ``from_pretrained`` would: checkpoint names are mapped as transformers maps them
    (``pretrained.model_names``), and tensors the checkpoint lacks keep their values while
    tensors the model lacks are ignored, each with a warning on rank 0 (a task head that the
    checkpoint does not hold stays as initialised). A peft model takes the checkpoint of the
    model it adapts; its adapters keep their values. A checkpoint that matches nothing raises.
    """
    rt = idle_world_runtime(model, "load_full")
    finish_pending(model)
    group = rt.mesh.whole
    path = Path(path)
    hf = pretrained.is_transformers(model)
    missing: list[str] = []
    extra: list[str] = []
    with ExitStack() as stack:
        plan = LoadPlan(stack, None, None)
        try:
            where = _standard_files(path)
            renamed = pretrained.model_names(model, list(where)) if hf else {n: n for n in where}
            stored_as = {m: s for s, m in renamed.items()}  # model name -> checkpoint name
            used: set[str] = set()
            targets = [
                (s.name, (s.name, *s.aliases), s.shape, s.held, s.rows_view(s.tensor.detach()))
                for s in param_slots(rt)
            ]
            for name, b in persistent_buffers(model).items():
                shape = tuple(b.shape)
                rows = shape[0] if shape else 1
                targets.append((name, (name,), shape, (0, rows), b.detach().view(rows, *shape[1:])))
            for name, names, shape, (lo, hi), dest in targets:
                present = [stored_as[n] for n in names if n in stored_as]
                if not present:
                    missing.append(name)
                    continue
                used.update(present)
                stored = present[0]
                rows = shape[0] if shape else 1
                plan.rows(stored, shape, None, [Piece(str(where[stored]), 0, rows)], lo, hi, dest)
            extra = sorted(set(where) - used)
            if hf and not used:
                plan.problem(f"{path} holds none of the model's tensors: it has {listed(extra)}")
            if missing and not hf:
                plan.problem(f"tensors missing from {path}: {listed(missing)}")
            if extra and not hf:
                plan.problem(f"{path} has tensors the model does not: {listed(extra)}")
        except Exception as e:  # any rank's failure must reach the others: see agree_on_problems
            plan.problem(str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}")
        agree_on_problems(plan, f"cannot load {path}", group)
        with torch.no_grad():
            for copy in plan.copies:
                copy()
    if hf and dist.get_rank(group) == 0:
        adapters = set(pretrained.adapter_only(model, missing))
        missing = [n for n in missing if n not in adapters]  # a base checkpoint has none
        if missing:
            warnings.warn(
                f"{path} has no values for {listed(missing)}: they keep their initial values, "
                "as transformers' from_pretrained leaves them newly initialised",
                stacklevel=2,
            )
        if extra:
            warnings.warn(
                f"{path} has tensors the model does not use, ignored: {listed(extra)}",
                stacklevel=2,
            )
