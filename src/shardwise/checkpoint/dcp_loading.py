"""``load`` of a torch.distributed.checkpoint (DCP) directory, as FSDP2 or torchtitan wrote it
(dcp.py), into a sharded model and its optimizer, at any world size, wrap and strategy.

Planning reads only the metadata (safely) and the small plain values (param groups, the step):
the model's names are found under ``model.`` or at the top level (torchtitan), the
optimizer's under ``<prefix>state.<param>.<key>``; shapes, dtypes and hyper-parameter names are
checked. The ranks agree (one all-gather) and all raise before anything changed, or each rank
reads the saved chunks that overlap the rows it owns now, straight into its shard.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ..core import collectives as C
from ..core.policies import Sharding
from . import dcp
from .index import CheckpointError
from .load_plan import CheckpointInfo, LoadPlan, agree_on_problems, listed
from .state import ParamSlot, idle_world_runtime, optimizers, param_slots, persistent_buffers

_MODEL_PREFIXES = (dcp.MODEL, "")  # FSDP2's {"model": ...}, torchtitan's flattened model


def load(
    path: Path,
    model: nn.Module,
    optimizer,
    names: Callable[[str], str] | None,
) -> CheckpointInfo:
    """See ``shardwise.load``: a DCP directory (``.metadata`` and ``*.distcp``)."""
    rt = idle_world_runtime(model, "load")
    group = rt.mesh.whole
    plan = LoadPlan(None, path, None)
    info: dict[str, Any] = {}
    install: list[Callable[[], None]] = []
    reading = None
    try:
        reading = dcp.Reading(path)
        _plan_load(plan, reading, path, model, rt, optimizer, names or (lambda n: n), info, install)
    except Exception as e:  # any rank's failure must reach the others
        plan.problem(str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}")
    agree_on_problems(plan, f"cannot load {path}", group)
    failure = ""
    try:
        with torch.no_grad():
            reading.run()
        for step in install:
            step()
    except Exception as e:  # after the agreement: every rank must still hear of it
        failure = f"rank {dist.get_rank(group)}: {type(e).__name__}: {e}"
    failures: list = [None] * dist.get_world_size(group)
    C.blocking(
        "all_gather", "DCP load outcome", dist.all_gather_object, failures, failure, group=group
    )
    if any(failures):
        raise CheckpointError(
            f"reading {path} failed part-way, the model may be partly loaded: "
            + "; ".join(f for f in failures if f)
        )
    return _info(path, info)


def _plan_load(plan, reading, path, model, rt, optimizer, rename, info, install) -> None:
    """Read the small values into ``info`` and check everything; plan the tensors' reads (into
    the model's shards and new optimizer state) and add what installs the optimizer's."""
    md = reading.metadata.state_dict_metadata
    slots = param_slots(rt)
    buffers = persistent_buffers(model)
    aliases = {a for s in slots for a in s.aliases}
    under, stored = model_names(md, [s.name for s in slots] + list(buffers), aliases, rename)
    # model name -> the name its optimizer state is stored under (without ``model.``)
    bare = {n: k[len(under) :] for n, k in stored.items()}
    for key in (dcp.SHARDWISE, "train_state.step"):
        if isinstance(md.get(key), BytesStorageMetadata):
            reading.value(key)
        elif isinstance(md.get(key), TensorStorageMetadata) and not md[key].size:
            info[key] = torch.zeros((), dtype=md[key].properties.dtype)
            reading.rows(key, 0, 1, info[key])
    opts = optimizers(optimizer)
    if len(opts) > 1:
        raise CheckpointError("a DCP checkpoint holds one optimizer's state: pass one optimizer")
    prefix = optimizer_prefix(md, [bare[s.name] for s in slots]) if opts else None
    if opts and prefix is None:
        raise CheckpointError(
            f"{path} holds no optimizer state for the model's parameters: pass "
            "optimizer=None to load the model alone"
        )
    if prefix is not None:  # param groups and plain state, to be checked before any change
        for key, entry in md.items():
            if key.startswith(prefix) and isinstance(entry, BytesStorageMetadata):
                reading.value(key)
    info.update(reading.run())  # only the small values: the tensors' reads come next
    for s in slots:
        dest = s.rows_view(s.tensor.detach())
        _plan_rows(plan, reading, md, stored[s.name], s.name, s.shape, s.tensor.dtype, s.held, dest)
    for name, b in buffers.items():
        rows = b.shape[0] if b.dim() else 1
        dest = b.detach().view(rows, *b.shape[1:])
        _plan_rows(plan, reading, md, stored[name], name, tuple(b.shape), b.dtype, (0, rows), dest)
    if prefix is not None:
        install.append(_plan_optimizer(plan, reading, md, opts[0], slots, bare, prefix, info))


def _info(path: Path, values: dict[str, Any]) -> CheckpointInfo:
    saved = json.loads(values[dcp.SHARDWISE]) if dcp.SHARDWISE in values else {}
    step = saved.get("step")
    if step is None and "train_state.step" in values:
        step = int(values["train_state.step"])
    strategy = saved.get("strategy")
    return CheckpointInfo(
        path,
        step,
        saved.get("extra"),
        saved.get("world_size"),
        Sharding.of(strategy) if strategy else None,
        False,
    )


_RENAMED = "a model whose modules were renamed takes names=, a function from the checkpoint's names to the model's"


def model_names(
    md: dict,
    wanted: list[str],
    aliases: set[str],
    rename: Callable[[str], str],
    fix: str = _RENAMED,
) -> tuple[str, dict[str, str]]:
    """The prefix (``model.`` or none) under which the checkpoint holds every model name (after
    ``rename``, checkpoint name -> model name), and model name -> checkpoint key. A tied
    parameter's other names (``aliases``) may be stored too, as FSDP2's state dict has them.
    ``fix``: what the error for names that differ tells to do."""
    best: tuple[int, str, dict[str, str]] | None = None
    for prefix in _MODEL_PREFIXES:
        found = {
            rename(k[len(prefix) :]): k
            for k, v in md.items()
            if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)
        }
        have = sum(n in found for n in wanted)
        if have == len(wanted):
            if prefix:  # under "model." everything is the model's
                extra = sorted(set(found) - set(wanted) - aliases)
                if extra:
                    raise CheckpointError(
                        f"tensors in the checkpoint that the model does not have: {listed(extra)}; "
                        + fix
                    )
            return prefix, {n: found[n] for n in wanted}
        if best is None or have > best[0]:
            best = (have, prefix, found)
    _, prefix, found = best
    missing = [n for n in wanted if n not in found]
    raise CheckpointError(
        f"tensors missing from the checkpoint (looked under '{prefix or 'the top level'}'): "
        f"{listed(missing)}; {fix}"
    )


def _plan_rows(plan, reading, md, key, name, shape, dtype, held, dest) -> bool:
    entry = md[key]
    if tuple(entry.size) != shape:
        plan.problem(
            f"tensor '{key}' has shape {list(entry.size)} in the checkpoint; '{name}' needs {list(shape)}"
        )
        return False
    if entry.properties.dtype != dtype:
        plan.problem(
            f"tensor '{key}' is {entry.properties.dtype} in the checkpoint; '{name}' needs {dtype}"
        )
        return False
    lo, hi = held
    if hi > lo:
        reading.rows(key, lo, hi, dest if shape else dest.view(()))
    return True


def optimizer_prefix(md: dict, params: list[str]) -> str | None:
    """The prefix of the optimizer's keys (``optimizer.``, ``optim.``, ...) for the parameters
    stored under the names ``params``, or None."""
    for name in params:
        marker = f"state.{name}."
        for key in md:
            at = key.find(marker)
            if at >= 0 and (at == 0 or key[at - 1] == "."):
                return key[:at]
    return None


def _plan_optimizer(plan, reading, md, opt, slots, bare, prefix, values) -> Callable[[], None]:
    """Check the optimizer against the checkpoint's param groups and plan its state's reads;
    return what installs the state and the hyper-parameters."""
    cls = type(opt).__name__
    by_id = {id(s.tensor): s for s in slots}
    groups = saved_groups(prefix, values)
    hypers: list[dict] = []
    for gi, g in enumerate(opt.param_groups):
        keys = [bare[by_id[id(p)].name] for p in g["params"]]
        saved = groups.get(keys[0]) if keys else None
        if saved is None or any(groups.get(k) is not saved for k in keys):
            raise CheckpointError(
                f"{cls} param group {gi} ({listed(keys)}) matches no param group of the checkpoint"
            )
        mine = set(g) - {"params"}
        theirs = set(saved)
        if theirs - mine:
            raise CheckpointError(
                f"the checkpoint's optimizer is not a {cls}: its param groups have "
                f"{sorted(theirs - mine)}, which {cls}'s lack"
            )
        hypers.append(saved)  # keys a newer torch added keep this optimizer's values
    per_element = per_element_keys(md, prefix, {bare[s.name]: s.shape for s in slots})
    state: dict[ParamSlot, dict[str, Any]] = {}
    for g in opt.param_groups:
        for p in g["params"]:
            s = by_id[id(p)]
            if s.elsewhere:  # owned by another rank: it holds the state
                continue
            base = f"{prefix}state.{bare[s.name]}."
            for key, entry in md.items():
                if not key.startswith(base) or "." in key[len(base) :]:
                    continue
                k = key[len(base) :]
                if isinstance(entry, BytesStorageMetadata):
                    v = values[key]
                    if v is not None and not isinstance(v, (bool, int, float)):
                        plan.problem(
                            f"optimizer state '{key}' is a {type(v).__name__}: only tensors and numbers load"
                        )
                    state.setdefault(s, {})[k] = v
                elif k in per_element and tuple(entry.size) == s.shape:
                    dest = torch.empty(
                        s.tensor.shape, dtype=entry.properties.dtype, device=s.tensor.device
                    )
                    _plan_rows(
                        plan,
                        reading,
                        md,
                        key,
                        key,
                        s.shape,
                        entry.properties.dtype,
                        s.held,
                        s.rows_view(dest),
                    )
                    state.setdefault(s, {})[k] = dest
                elif not entry.size:
                    device = (
                        s.tensor.device
                        if g.get("capturable") or g.get("fused")
                        else torch.device("cpu")
                    )
                    dest = torch.empty((), dtype=entry.properties.dtype, device=device)
                    reading.rows(key, 0, 1, dest)
                    state.setdefault(s, {})[k] = dest
                else:
                    plan.problem(
                        f"optimizer state '{key}' has shape {list(entry.size)}; its parameter has "
                        f"{list(s.shape)}: state tensors must be shaped like their parameter or 0-dim"
                    )

    def install() -> None:
        opt.state.clear()
        for s, st in state.items():
            opt.state[s.tensor] = st
        for g, saved in zip(opt.param_groups, hypers):
            for k, v in saved.items():
                g[k] = tuple(v) if isinstance(g.get(k), tuple) else v

    return install


def saved_groups(prefix: str, values: dict[str, Any]) -> dict[str, dict]:
    """Checkpoint parameter name -> its param group's hyper-parameters (one dict per group),
    from FSDP2's ``param_groups.<i>.<hyper>`` with ``params``, or torchtitan's flattened
    ``param_groups.<param>.<hyper>``."""
    head = prefix + "param_groups."
    raw: dict[str, dict[str, Any]] = {}
    for key, v in values.items():
        if key.startswith(head):
            owner, _, hyper = key[len(head) :].rpartition(".")
            raw.setdefault(owner, {})[hyper] = v
    out: dict[str, dict] = {}
    for owner, hypers in raw.items():
        if owner.isdigit() and "params" in hypers:  # FSDP2: a group by index, with its names
            group = {k: v for k, v in hypers.items() if k != "params"}
            out.update(dict.fromkeys(hypers["params"], group))
    for owner, hypers in raw.items():
        if owner not in out and "params" not in hypers:  # torchtitan: per parameter
            out[owner] = hypers
    # parameters of one flattened group hold equal dicts: make them the same object
    unique: list[dict] = []
    for owner, group in out.items():
        same = next((u for u in unique if u == group), None)
        if same is None:
            unique.append(group)
        else:
            out[owner] = same
    return out


def per_element_keys(md: dict, prefix: str, shapes: dict[str, tuple[int, ...]]) -> set[str]:
    """State keys stored shaped like their parameter (stored name -> shape) for some parameter
    that is not 0-dim (a 0-dim parameter's moments look like Adam's 0-dim ``step``)."""
    keys = set()
    for name, shape in shapes.items():
        if not shape:
            continue
        base = f"{prefix}state.{name}."
        for key, entry in md.items():
            if (
                key.startswith(base)
                and isinstance(entry, TensorStorageMetadata)
                and tuple(entry.size) == shape
            ):
                keys.add(key[len(base) :])
    return keys
