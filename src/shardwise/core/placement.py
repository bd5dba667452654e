"""Placement policies: which parameters of a wrapped unit are held whole by one rank.

A placement is ``callable(name, param) -> "rows" | "owned"``, asked for every parameter of
every wrapped unit (the root unit's parameters, what the wrap policy left: embeddings, the
output head, final norms, stay in rows). "rows" is the default layout: every rank holds 1/N of
the rows. "owned": one rank, chosen here, holds the whole tensor, its gradient and its
optimizer state; the unit's gather brings it from its owner and its gradient is reduced to
its owner (Note [placement] in layout.py). Optimizers whose math needs whole matrices (Muon's
Newton–Schulz, Adafactor's factored moments) are then exact, with no collective in ``step()``.

    shardwise.shard(model, wrap=..., placement=shardwise.placement.matrices)
    muon = torch.optim.Muon([p for p in model.parameters() if shardwise.placement.is_owned(p)])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from .errors import ShardwiseError
from .layout import Slot

Placement = Callable[[str, nn.Parameter], str]
PLACEMENTS = ("rows", "owned")


def rows(name: str, param: nn.Parameter) -> str:
    """Every parameter in rows (the default)."""
    return "rows"


def matrices(name: str, param: nn.Parameter) -> str:
    """Every parameter of 2 or more dims owned (weights of linear layers, stacked experts);
    1-D parameters (norms, biases) in rows."""
    return "owned" if param.dim() >= 2 else "rows"


def ask(placement: Placement, name: str, param: nn.Parameter) -> bool:
    """Whether ``placement`` owns the parameter ``name``; a bad answer raises, naming it."""
    answer = placement(name, param)
    if answer not in PLACEMENTS:
        raise ShardwiseError(
            f"placement {getattr(placement, '__name__', placement)!r} returned {answer!r} for "
            f"'{name}'; a placement returns 'rows' or 'owned' (e.g. shardwise.placement.matrices)"
        )
    return answer == "owned"


def choose_owners(units: Sequence[Sequence[tuple[int, bool]]], world: int) -> list[list[int | None]]:
    """An owner for every owned parameter: each unit's, largest first, goes to the rank that
    holds the fewest owned elements so far (ties: the lowest rank). Greedy assignment keeps
    the ranks within one parameter of each other, and each unit's gather spread over them.

    ``units[u][i]`` is (numel, owned) of parameter i of unit u; deterministic, so every rank
    computes the same owners."""
    load = [0] * world
    out = []
    for params in units:
        owners: list[int | None] = [None] * len(params)
        for i in sorted((i for i, (_, owned) in enumerate(params) if owned), key=lambda i: -params[i][0]):
            r = min(range(world), key=lambda r: (load[r], r))
            owners[i] = r
            load[r] += params[i][0]
        out.append(owners)
    return out


@dataclass(frozen=True)
class Placed:
    """Where a shard parameter (from a sharded model's ``parameters()``) lives across the
    ranks, as ``shard()`` laid it out: the record every reader of placement asks (``of``)."""

    name: str  # its qualified name (the first, for a shared parameter)
    owner: int | None  # the rank that holds it whole; None: rows on every rank
    split: bool  # a matrix (2-D) whose rows are split across ranks

    @property
    def owned(self) -> bool:
        return self.owner is not None


def mark(param: nn.Parameter, slot: Slot, world: int) -> None:
    """Record where ``param``, the shard parameter of ``slot`` in a layout over ``world``
    ranks, lives."""
    param._shardwise_placement = Placed(slot.name, slot.owner, not slot.owned and len(slot.shape) == 2 and world > 1)


def of(param: torch.Tensor) -> Placed | None:
    """The placement of a shard parameter; None for a tensor shardwise did not lay out."""
    return getattr(param, "_shardwise_placement", None)


def is_owned(param: torch.Tensor) -> bool:
    """Whether the placement owns ``param`` (from a sharded model's ``parameters()``), on its
    owner or not, so that every rank selects the same parameters for a whole-matrix optimizer
    (under no_shard, where every rank holds every parameter whole, the same ones are marked)."""
    placed = of(param)
    return placed is not None and placed.owned


# --- optimizers that need whole matrices
_whole_matrix: list[type] = [
    cls for cls in (getattr(torch.optim, "Muon", None), getattr(torch.optim, "Adafactor", None)) if cls is not None
]


def needs_whole_matrices(optimizer_class: type) -> type:
    """Register an optimizer class whose step needs whole matrices: its first ``step()`` over
    parameters whose rows are split across ranks raises instead of training silently wrong.
    (torch.optim.Muon and torch.optim.Adafactor are registered.) Usable as a class decorator."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"needs_whole_matrices takes a torch.optim.Optimizer subclass, got {optimizer_class!r}")
    if optimizer_class not in _whole_matrix:
        _whole_matrix.append(optimizer_class)
    return optimizer_class


def check_whole_matrices(optimizer: torch.optim.Optimizer) -> None:
    """Refuse a registered whole-matrix optimizer that steps matrices split in rows."""
    if not isinstance(optimizer, tuple(_whole_matrix)):
        return
    placed = [of(p) for g in optimizer.param_groups for p in g["params"]]
    split = [p.name for p in placed if p is not None and p.split]
    if split:
        shown = ", ".join(f"'{n}'" for n in split[:3]) + (f" and {len(split) - 3} more" if len(split) > 3 else "")
        raise ShardwiseError(
            f"{type(optimizer).__name__} needs whole matrices, but {shown} are split in rows across "
            "ranks, so its step would compute on each rank's slice and train silently wrong. Shard "
            "with shardwise.shard(..., placement=shardwise.placement.matrices) (matrices of wrapped "
            "units are then held whole by one rank each), and give this optimizer the parameters "
            "for which shardwise.placement.is_owned(p) is true."
        )
