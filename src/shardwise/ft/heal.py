"""What one rank hands a rank of a joining group, and how that rank takes it: its parameter
shards, optimizer state (hyper-parameters included), persistent buffers and loss scale, by
name, read through the per-rank description checkpoints use (checkpoint/state.py). Nothing
is gathered: rank r of a live group serves exactly what it holds to rank r of the joining
group, which must hold the same (``Holding``; ``CannotHeal`` says what differs).

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

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from ..checkpoint.state import ParamSlot, optimizer_names, param_slots, persistent_buffers
from ..core.runtime import Runtime
from .errors import CannotHeal


@dataclass(frozen=True)
class Held:
    """One parameter as this rank holds it: its rows here, and whether another rank owns it."""

    name: str
    shape: tuple[int, ...]
    rows: tuple[int, int]
    elsewhere: bool
    dtype: str

    def __str__(self) -> str:
        owned = ", owned elsewhere" if self.elsewhere else ""
        return f"'{self.name}' {list(self.shape)} rows {list(self.rows)} ({self.dtype}{owned})"


@dataclass(frozen=True)
class Holding:
    """What a rank (``rank`` of its group's ``ranks``) holds, as plain data two groups
    compare: their ranks, strategy, each parameter's rows, the optimizers' classes and the
    parameters each steps."""

    ranks: int
    rank: int
    strategy: str
    params: tuple[Held, ...]
    optimizers: tuple[tuple[str, tuple[tuple[str, ...], ...]], ...]

    @staticmethod
    def of(rt: Runtime, optimizers: list[torch.optim.Optimizer], slots: list[ParamSlot], rank: int, ranks: int) -> Holding:
        return Holding(
            ranks, rank, rt.sharding.value,
            tuple(Held(s.name, tuple(s.shape), tuple(s.held), bool(s.elsewhere), str(s.tensor.dtype)) for s in slots),
            tuple((type(o).__name__, tuple(map(tuple, optimizer_names(o, slots)))) for o in optimizers),
        )

    def fingerprint(self) -> list[float]:
        """Three 20-bit numbers from this holding and their squares: averaged over groups, they
        stay themselves only where every group has the same (the variance is then zero)."""
        digest = hashlib.sha256(repr(self).encode()).digest()
        parts = [int.from_bytes(digest[i : i + 3], "big") >> 4 for i in (0, 3, 6)]
        return [float(v) for p in parts for v in (p, p * p)]

    def difference(self, mine: Holding) -> str:
        """How ``mine`` (this rank's) differs from this one (a live rank's), in words."""
        for key in ("ranks", "strategy"):
            if getattr(self, key) != getattr(mine, key):
                return f"its group runs {getattr(self, key)!r} as {key}, this group {getattr(mine, key)!r}"
        for a, b in zip(self.params, mine.params):
            if a != b:
                return f"its rank {self.rank} holds parameter {a}; this rank holds {b}"
        if len(self.params) != len(mine.params):
            return f"its model has {len(self.params)} parameters, this one {len(mine.params)}"
        return f"its optimizers are {self.optimizers}, this group's {mine.optimizers}"


@dataclass(frozen=True)
class Snapshot:
    """What a rank serves a healing rank (the module's docstring): by reference the parameter
    shards and optimizer state, by copy the buffers, hyper-parameters and loss scale."""

    holding: Holding
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    optimizers: list[dict[str, Any]]  # per optimizer: {"state": by parameter name, "hyper": per group}
    scaler: dict | None

    def with_params(self, params: dict[str, torch.Tensor]) -> Snapshot:
        return dataclasses.replace(self, params=params)


@dataclass(frozen=True)
class Transient:
    """What forward, backward and the loss scaler change outside the optimizer's step, copied
    at a step's start so that a step that does not commit can be undone."""

    buffers: dict[str, torch.Tensor]
    residuals: dict[tuple[int, str], torch.Tensor]  # (unit index, kind): error feedback
    scaler: dict | None


def transient(rt: Runtime, scaler, buffers: dict | None = None) -> Transient:
    """``Transient`` copies, taken at the start of a step, after any heal (``restore_transient``
    undoes a step with them). ``buffers``: copies of the buffers taken at this step's start
    already (the ``snapshot``'s, where no heal changed them since), kept instead of copying
    them again."""
    if buffers is None:
        buffers = {n: b.detach().clone() for n, b in persistent_buffers(rt.root).items()}
    residuals = {(i, kind): t.detach().clone() for i, u in enumerate(rt.units) for kind, t in u.residuals.items()}
    return Transient(buffers, residuals, scaler.state_dict() if scaler is not None else None)


def restore_transient(rt: Runtime, scaler, kept: Transient) -> None:
    """Undo a step that did not commit outside the optimizer (which did not step)."""
    with torch.no_grad():
        for name, b in persistent_buffers(rt.root).items():
            b.copy_(kept.buffers[name])
    for i, unit in enumerate(rt.units):
        unit.set_residuals({kind: t.clone() for (j, kind), t in kept.residuals.items() if j == i})
    if scaler is not None and kept.scaler is not None:
        scaler.load_state_dict(kept.scaler)


def snapshot(rt: Runtime, optimizers: list[torch.optim.Optimizer], scaler, holding: Holding) -> Snapshot:
    """What this rank serves a healing rank at the start of a step (the module's docstring);
    ``holding`` does not change."""
    slots = param_slots(rt)
    by_id = {id(s.tensor): s.name for s in slots}
    return Snapshot(
        holding,
        {s.name: s.tensor.detach() for s in slots},
        {n: b.detach().clone() for n, b in persistent_buffers(rt.root).items()},
        [
            {
                "state": {by_id[id(p)]: dict(st) for p, st in o.state.items()},
                "hyper": [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups],
            }
            for o in optimizers
        ],
        scaler.state_dict() if scaler is not None else None,
    )


def apply(
    rt: Runtime, optimizers: list[torch.optim.Optimizer], scaler, state: Snapshot, mine: Holding, source: str
) -> None:
    """Take a live rank's ``state`` (``snapshot`` of the same rank of another group); ``mine``
    is what this rank holds."""
    slots = param_slots(rt)
    if state.holding != mine:
        raise CannotHeal(f"cannot heal from {source}: {state.holding.difference(mine)}. {FIX}")
    by_name = {s.name: s for s in slots}
    with torch.no_grad():
        for name, t in state.params.items():
            by_name[name].tensor.detach().copy_(t)
        for name, b in persistent_buffers(rt.root).items():
            b.copy_(state.buffers[name])
    for o, saved in zip(optimizers, state.optimizers):
        o.state.clear()
        groups = {n: g for names, g in zip(optimizer_names(o, slots), o.param_groups) for n in names}
        for name, st in saved["state"].items():
            p = by_name[name].tensor
            o.state[p] = {k: _placed(v, p, groups[name]) for k, v in st.items()}
        for g, hyper in zip(o.param_groups, saved["hyper"]):
            g.update(hyper)
    for unit in rt.units:  # (this group's own, see the module's docstring)
        unit.set_residuals({})
    if scaler is not None and state.scaler is not None:
        scaler.load_state_dict(state.scaler)


def _placed(value, p: torch.Tensor, group: dict):
    """An optimizer state value where torch keeps it: beside its parameter, except 0-dim
    counters such as Adam's step, on the host unless the step runs on the device."""
    if not torch.is_tensor(value):
        return value
    on_device = value.dim() > 0 or group.get("capturable") or group.get("fused")
    return value.to(p.device if on_device else torch.device("cpu"), copy=True)


FIX = (
    "Replica groups train together rank for rank, so every group must shard the same model the "
    "same way: the same number of ranks, strategy, wrap and placement, and the same optimizers. "
    "Jobs of different sizes train together with hybrid sharding over the same shard size "
    "(strategy='hybrid_shard', shard_size= the ranks of one node) or with no_shard. "
    "A checkpoint moves a run between layouts: shardwise.save, then shardwise.load"
)
