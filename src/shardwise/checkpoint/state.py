"""What a sharded model and its optimizer hold on this rank, by name and by rows.

Parameters are named by their first qualified name (a tied parameter's other names are its
aliases). Every tensor is split by rows as the layout splits parameters: rank r of N owns rows
``[r*R, (r+1)*R)``, R = ceil(rows / N), a 0-dim tensor counting as one row; an owned
parameter's owner holds all its rows and its optimizer state, the other ranks none. A sharded unit's
rank holds and saves just those rows; a replicated (no_shard) unit's rank holds all rows but
saves only its share, so every rank writes 1/N of every tensor whatever the strategy. With
hybrid sharding N is the shard group's size, and only the first replica (the shard group
holding rank 0) saves its rows: every row is written once, not once per replica.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from ..core import runtime as runtimes
from ..core.layout import Layout
from ..core.runtime import Runtime
from ..core.unit import ShardedUnit
from .index import CheckpointError


def owned_rows(shape: tuple[int, ...], rank: int, world: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a tensor of ``shape`` that ``rank`` of ``world`` owns."""
    return Layout.build([("", shape)], world).slots[0].row_range(rank)


@dataclass(frozen=True)
class ParamSlot:
    """One parameter of the model as this rank holds it."""

    name: str  # first qualified name
    aliases: tuple[str, ...]  # its other qualified names (tied parameters)
    shape: tuple[int, ...]  # full shape
    held: tuple[int, int]  # rows of the full parameter that ``tensor`` holds
    saved: tuple[int, int]  # rows this rank writes (within ``held``; none outside the first replica)
    tensor: nn.Parameter  # what model.parameters() yields: the shard, or the whole parameter
    # this rank writes the parameter's optimizer scalars and numbers: rank 0, or for an owned
    # parameter its owner in the first replica (the only rank whose optimizer steps it)
    writes_whole: bool
    elsewhere: bool  # owned by another rank: this one holds none of it and no optimizer state

    def rows_view(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (shaped like ``tensor``) viewed as its held rows: ``(rows, *shape[1:])``."""
        return t.view(self.held[1] - self.held[0], *self.shape[1:])


def idle_world_runtime(model: nn.Module, what: str) -> Runtime:
    """The model's runtime, idle, its mesh spanning the whole world (sharded over it, or
    hybrid: sharded within groups and replicated across them)."""
    rt = runtimes.runtime_of(model)
    runtimes.require_idle(rt, what)
    if dist.get_world_size(rt.mesh.whole) != dist.get_world_size():
        raise NotImplementedError(
            f"{what}() of a model sharded over a subgroup of the world is not supported: shard the "
            "model over the default group"
        )
    return rt


def param_slots(rt: Runtime) -> list[ParamSlot]:
    """Every parameter of the model, in ``named_parameters()`` order."""
    writes = rt.mesh.in_first_shard_group()
    rank0 = dist.get_rank() == 0
    slots = []
    for unit in rt.units:
        names: dict[int, list[str]] = {}
        for r in unit.registrations:
            names.setdefault(r.index, []).append(r.fqn)
        sharded = isinstance(unit, ShardedUnit)
        params = unit.shard_params if sharded else unit.params
        for i, p in enumerate(params):
            first, *aliases = names[i]
            shape = tuple(unit.full_params[i].shape)
            owner = unit.layout.slots[i].owner if sharded else None
            if owner is None:
                mine, whole = owned_rows(shape, unit.rank, unit.world), rank0
            else:
                mine, whole = unit.layout.slots[i].row_range(unit.rank), writes and owner == unit.rank
            held = mine if sharded else (0, shape[0] if shape else 1)
            saved = mine if writes else (mine[0], mine[0])
            elsewhere = owner is not None and owner != unit.rank
            slots.append(ParamSlot(first, tuple(aliases), shape, held, saved, p, whole, elsewhere))
    order = {name: i for i, (name, _) in enumerate(rt.root.named_parameters())}
    return sorted(slots, key=lambda s: order[s.name])


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a state dict holds (persistent ones), by their first qualified name."""
    out = {}
    for mname, module in model.named_modules():
        for bname, b in module._buffers.items():
            if b is None or bname in module._non_persistent_buffers_set:
                continue
            fqn = f"{mname}.{bname}" if mname else bname
            if not any(b is seen for seen in out.values()):
                out[fqn] = b
    return out


def per_element_keys(optimizer: torch.optim.Optimizer) -> set[str]:
    """State keys whose tensors are shaped like their parameter (e.g. Adam's moments).

    A 0-dim parameter (only whole under no_shard) cannot tell its moments from a 0-dim
    scalar such as Adam's ``step`` by shape, so keys are judged on the other parameters.
    """
    keys = set()
    for p, st in optimizer.state.items():
        if p.dim() > 0:
            keys.update(k for k, v in st.items() if torch.is_tensor(v) and v.shape == p.shape)
    return keys


def is_per_element(p: torch.Tensor, key: str, value, keys: set[str]) -> bool:
    if not torch.is_tensor(value) or value.shape != p.shape:
        return False
    return p.dim() > 0 or key in keys


def optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """One optimizer or several (e.g. Muon on the matrices, AdamW on the rest) as a list."""
    if optimizer is None:
        return []
    opts = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    bad = [type(o).__name__ for o in opts if not isinstance(o, torch.optim.Optimizer)]
    if bad:
        raise CheckpointError(f"optimizer must be a torch.optim.Optimizer or a list of them, got {bad}")
    owner: dict[int, int] = {}
    for i, opt in enumerate(opts):
        for gi, g in enumerate(opt.param_groups):
            for pi, p in enumerate(g["params"]):
                first = owner.setdefault(id(p), i)
                if first != i:
                    raise CheckpointError(
                        f"optimizers {first} ({type(opts[first]).__name__}) and {i} "
                        f"({type(opt).__name__}) both hold one parameter (param group {gi}, "
                        f"position {pi}, shape {tuple(p.shape)}): a checkpoint keys optimizer "
                        "state by parameter, so their states would mix. Save each in a "
                        "checkpoint of its own (ft.diloco: shardwise.save(path, model, opt.outer))"
                    )
    return opts


def optimizer_names(optimizer: torch.optim.Optimizer, slots: list[ParamSlot]) -> list[list[str]]:
    """The parameter names of each param group; raises if the optimizer holds a tensor that
    is not one of the model's parameters on this rank."""
    by_id = {id(s.tensor): s.name for s in slots}
    groups = []
    for gi, g in enumerate(optimizer.param_groups):
        names = []
        for pi, p in enumerate(g["params"]):
            if id(p) not in by_id:
                raise CheckpointError(
                    f"{type(optimizer).__name__} param group {gi} holds a tensor (position "
                    f"{pi}, shape {tuple(p.shape)}) that is not a parameter of the sharded "
                    "model: build the optimizer after shard(), from model.parameters()"
                )
            names.append(by_id[id(p)])
        groups.append(names)
    return groups
