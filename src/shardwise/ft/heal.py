"""What one rank hands a rank of a joining group, and how that rank takes it: its parameter
shards, optimizer state (hyper-parameters included), persistent buffers and loss scale, by
name, read through the per-rank description checkpoints use (checkpoint/state.py). Nothing
is gathered: rank r of a live group serves exactly what it holds to rank r of the joining
group, whose layout must be the same (``layout``; ``CannotHeal`` says what differs).

Error feedback residuals are not handed over: they hold what encoding dropped from the rows
this group sent, of its own gradients, and added to another group's rows they would send that
error twice. A healed rank starts them from zero, as a checkpoint loaded at another world size
does.

The snapshot is taken at the start of a step (``Torchft``'s quorum): parameters and optimizer
state are served by reference (nothing changes them before the step commits, and torchft's
transport finishes serving before it does); what forward and backward change (buffers,
residuals) and plain values (hyper-parameters, the loss scale) are copied, so a step that
does not commit can be rolled back to them (``restore_transient``).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from ..checkpoint.state import ParamSlot, optimizer_names, param_slots, persistent_buffers
from ..runtime import Runtime
from .errors import CannotHeal


def layout(rt: Runtime, optimizers: list[torch.optim.Optimizer], slots: list[ParamSlot], rank: int, ranks: int) -> dict:
    """What this rank (``rank`` of its group's ``ranks``) holds, as plain data that two groups
    compare: their ranks, strategy, each parameter's rows here (and whether another rank owns
    it), the optimizers' classes and parameters."""
    return {
        "ranks": ranks,
        "rank": rank,
        "strategy": rt.sharding.value,
        "params": [(s.name, s.shape, s.held, s.elsewhere, str(s.tensor.dtype)) for s in slots],
        "optimizers": [(type(o).__name__, optimizer_names(o, slots)) for o in optimizers],
    }


def fingerprint(description: dict) -> list[float]:
    """Three 20-bit numbers from ``description`` and their squares: averaged over groups, they
    stay themselves only where every group has the same (the variance is then zero)."""
    digest = hashlib.sha256(repr(description).encode()).digest()
    parts = [int.from_bytes(digest[i : i + 3], "big") >> 4 for i in (0, 3, 6)]
    return [float(v) for p in parts for v in (p, p * p)]


def transient(rt: Runtime, scaler, buffers: dict | None = None) -> dict[str, Any]:
    """Copies of what forward, backward and the loss scaler change outside the optimizer's
    step (buffers, error feedback residuals, the loss scale), taken at the start of a step,
    after any heal, so that a step that does not commit can be undone (``restore_transient``).
    ``buffers``: copies of the buffers taken at this step's start already (the ``snapshot``'s,
    where no heal changed them since), kept instead of copying them again."""
    if buffers is None:
        buffers = {n: b.detach().clone() for n, b in persistent_buffers(rt.root).items()}
    return {
        "buffers": buffers,
        "residuals": {
            (i, kind): t.detach().clone() for i, u in enumerate(rt.units) for kind, t in u.residuals.items()
        },
        "scaler": scaler.state_dict() if scaler is not None else None,
    }


def restore_transient(rt: Runtime, scaler, kept: dict[str, Any]) -> None:
    """Undo a step that did not commit outside the optimizer (which did not step)."""
    with torch.no_grad():
        for name, b in persistent_buffers(rt.root).items():
            b.copy_(kept["buffers"][name])
    for i, unit in enumerate(rt.units):
        unit.residuals = {kind: t.clone() for (j, kind), t in kept["residuals"].items() if j == i}
    if scaler is not None and kept["scaler"] is not None:
        scaler.load_state_dict(kept["scaler"])


def snapshot(rt: Runtime, optimizers: list[torch.optim.Optimizer], scaler, described: dict) -> dict[str, Any]:
    """What this rank serves a healing rank at the start of a step (the module's docstring);
    ``described`` is its ``layout``, which does not change."""
    slots = param_slots(rt)
    by_id = {id(s.tensor): s.name for s in slots}
    return {
        "layout": described,
        "params": {s.name: s.tensor.detach() for s in slots},
        "buffers": {n: b.detach().clone() for n, b in persistent_buffers(rt.root).items()},
        "optimizers": [
            {
                "state": {by_id[id(p)]: dict(st) for p, st in o.state.items()},
                "hyper": [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups],
            }
            for o in optimizers
        ],
        "scaler": scaler.state_dict() if scaler is not None else None,
    }


def apply(
    rt: Runtime, optimizers: list[torch.optim.Optimizer], scaler, state: dict[str, Any], mine: dict, source: str
) -> None:
    """Take a live rank's state (``snapshot`` of the same rank of another group); ``mine`` is
    this rank's ``layout``."""
    slots = param_slots(rt)
    if state["layout"] != mine:
        raise CannotHeal(f"cannot heal from {source}: {_difference(state['layout'], mine)}. {_FIX}")
    by_name = {s.name: s for s in slots}
    with torch.no_grad():
        for name, t in state["params"].items():
            by_name[name].tensor.detach().copy_(t)
        for name, b in persistent_buffers(rt.root).items():
            b.copy_(state["buffers"][name])
    for o, saved in zip(optimizers, state["optimizers"]):
        o.state.clear()
        groups = {n: g for names, g in zip(optimizer_names(o, slots), o.param_groups) for n in names}
        for name, st in saved["state"].items():
            p = by_name[name].tensor
            o.state[p] = {k: _placed(v, p, groups[name]) for k, v in st.items()}
        for g, hyper in zip(o.param_groups, saved["hyper"]):
            g.update(hyper)
    for unit in rt.units:  # (this group's own, see the module's docstring)
        unit.residuals = {}
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])


def _placed(value, p: torch.Tensor, group: dict):
    """An optimizer state value where torch keeps it: beside its parameter, except 0-dim
    counters such as Adam's step, on the host unless the step runs on the device."""
    if not torch.is_tensor(value):
        return value
    on_device = value.dim() > 0 or group.get("capturable") or group.get("fused")
    return value.to(p.device if on_device else torch.device("cpu"), copy=True)



def _difference(theirs: dict, mine: dict) -> str:
    for key in ("ranks", "strategy"):
        if theirs[key] != mine[key]:
            return f"its group runs {theirs[key]!r} as {key}, this group {mine[key]!r}"
    for a, b in zip(theirs["params"], mine["params"]):
        if a != b:
            return (
                f"its rank {theirs['rank']} holds parameter '{a[0]}' {list(a[1])} rows {list(a[2])} "
                f"({a[4]}{', owned elsewhere' if a[3] else ''}); this rank holds '{b[0]}' {list(b[1])} "
                f"rows {list(b[2])} ({b[4]}{', owned elsewhere' if b[3] else ''})"
            )
    if len(theirs["params"]) != len(mine["params"]):
        return f"its model has {len(theirs['params'])} parameters, this one {len(mine['params'])}"
    return f"its optimizers are {theirs['optimizers']}, this group's {mine['optimizers']}"


_FIX = (
    "Replica groups train together rank for rank, so every group must shard the same model the "
    "same way: the same number of ranks, strategy, wrap and placement, and the same optimizers. "
    "Jobs of different sizes train together with hybrid sharding over the same shard size "
    "(strategy='hybrid_shard', shard_size= the ranks of one node) or with no_shard. "
    "A checkpoint moves a run between layouts: shardwise.save, then shardwise.load"
)
