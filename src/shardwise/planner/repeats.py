"""Blocks alike: plan a model of L identical blocks from runs of a few of them.

Note [blocks alike]: a transformer is a stack of L blocks alike (one class, the same
parameters), and a step of a configuration that treats them alike is periodic: each block
gathers, saves, reduces and steps what the one before did. Every figure the plan reads off the
step (model state, bytes sent, the peak of each phase, the activations at their peak) is then
an affine function of L: what the rest of the model costs, plus L times what one block adds.
Planning the model with k, k+1 and k+2 of its blocks gives those two numbers, and the equal
differences of the three runs check that the figures are affine where they were measured
(else the full model is planned); the full model's figures follow. The peak's place follows
too: a unit it names is the same block in the three runs (counted from the first) or moves
with the last (counted from the end). The runs drop the blocks from the model's ``ModuleList``
after it is built on the meta device, so its forward must run over that list, as transformer
implementations do (``for layer in self.layers``); the three runs would disagree if it did
not. Planning 2+3+4 blocks costs what 9 do: a model of more than ``FROM`` blocks is planned
this way. Where the three runs disagree (the peak's place moves between small runs: at 2
blocks the root's backward, at 3 and more the last blocks'), the window moves up a block, to
``MOST`` blocks at most. tests/test_plan.py checks the figures equal the full model's, byte
for byte.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch.nn as nn

from ..core.policies import Settings
from .estimate import Estimate, UnitRow

FROM = 12  # blocks at least, for the runs of a few to cost less than the whole
FEW = 2  # the smallest run: FEW, FEW + 1 and FEW + 2 blocks
MOST = 8  # blocks at most in a run: where runs this long still disagree, the whole is planned


@dataclass(frozen=True)
class Repeats:
    """The blocks alike of a model: the ``ModuleList`` at ``path`` holds ``count`` units of
    one class and the same parameters."""

    path: str
    count: int

    def names(self, k: int) -> list[str]:
        return [f"{self.path}.{i}" for i in range(k)]

    def keep(self, model: nn.Module, k: int) -> nn.Module:
        """``model`` with the first ``k`` blocks only."""
        parent, _, attr = self.path.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, attr, nn.ModuleList(list(getattr(owner, attr))[:k]))
        return model


def find(model: nn.Module, unit_names: list[str]) -> Repeats | None:
    """The one ``ModuleList`` of more than ``FROM`` units alike, or None."""
    lists = {}
    for name in unit_names:
        path, _, index = name.rpartition(".")
        if index.isdigit() and path:
            lists.setdefault(path, []).append(int(index))
    found = []
    for path, indices in lists.items():
        blocks = model.get_submodule(path)
        if not isinstance(blocks, nn.ModuleList) or sorted(indices) != list(range(len(blocks))):
            continue
        if len(blocks) > FROM and len({_shape_of(b) for b in blocks}) == 1:
            found.append(Repeats(path, len(blocks)))
    return found[0] if len(found) == 1 else None


def together(model: nn.Module, unit_names: list[str]) -> list[tuple[str, ...]]:
    """The units in groups the budget search moves together (Note [blocks decided together]
    in budget.py): the blocks of each ``ModuleList`` of units alike, every other unit alone,
    in ``unit_names``' order."""
    lists: dict[str, list[str]] = {}
    for name in unit_names:
        path, _, index = name.rpartition(".")
        if index.isdigit() and path:
            lists.setdefault(path, []).append(name)
    group_of = {}
    for path, members in lists.items():
        blocks = model.get_submodule(path)
        if (
            isinstance(blocks, nn.ModuleList)
            and len(members) == len(blocks) > 1
            and len({_shape_of(b) for b in blocks}) == 1
        ):
            group_of.update({n: tuple(members) for n in members})
    out: list[tuple[str, ...]] = []
    for name in unit_names:
        group = group_of.get(name, (name,))
        if group not in out:
            out.append(group)
    return out


def _shape_of(block: nn.Module) -> tuple:
    return (
        type(block),
        tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters()),
        tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers()),
    )


def alike(settings: Settings, repeats: Repeats) -> bool:
    """Whether ``settings`` treat every block alike (no block a unit of its own, as under
    no_shard, counts: the blocks are then all in the root's)."""
    blocks = set(repeats.names(repeats.count))
    return len({c for n, c in settings.units if n in blocks}) <= 1


def truncated(settings: Settings, repeats: Repeats, k: int) -> Settings:
    """``settings`` for the model with its first ``k`` blocks."""
    blocks = set(repeats.names(repeats.count))
    units = []
    for n, c in settings.units:
        if n not in blocks:
            units.append((n, c))
        elif n == f"{repeats.path}.0":  # (the blocks' place among the units: innermost first)
            units += [(b, c) for b in repeats.names(k)]
    return Settings(settings.strategy, settings.wrap, tuple(units))


def plan_alike(
    run: Callable[[Settings, int], Estimate], settings: Settings, repeats: Repeats, step_check: int
) -> Estimate | None:
    """The estimate of ``settings`` on the whole model from runs of FEW, FEW + 1 and FEW + 2
    blocks (``run(settings, k)``), or None where the figures are not affine in the blocks.
    ``step_check``: the whole model's bytes for the step check, one all-reduce of a flag per
    trained parameter, whose booking rounds the whole down (accounting.theory)."""
    runs: dict[int, Estimate] = {}
    for k in range(FEW, MOST - 1):  # (the window of three runs moves up until they agree)
        for n in (k, k + 1, k + 2):
            if n not in runs:
                runs[n] = run(truncated(settings, repeats, n), n)
        whole = _affine([_numbers(runs[n], repeats, n) for n in (k, k + 1, k + 2)], repeats.count - k)
        peak_at = _place([runs[k], runs[k + 1], runs[k + 2]], repeats, k)
        if whole is not None and peak_at is not None:
            return _whole(runs[k], whole, peak_at, settings, repeats, k, step_check)
    return None


def _affine(numbers: list[dict[str, int]], more: int) -> dict[str, int] | None:
    """Each figure ``more`` blocks on from the first of three runs a block apart, or None
    where a figure does not grow by the same from run to run."""
    if any(set(n) != set(numbers[0]) for n in numbers):
        return None
    whole = {}
    for key in numbers[0]:
        a, b, c = (n[key] for n in numbers)
        if b - a != c - b:
            return None
        whole[key] = a + more * (b - a)
    return whole


def _whole(e: Estimate, whole: dict, peak_at: str, settings: Settings, repeats: Repeats, k: int, step_check: int) -> Estimate:
    """The whole model's estimate from the run ``e`` of ``k`` blocks and the figures."""
    comm = {key: whole[f"comm.{key}"] if key != "step_check" else step_check for key in e.comm}
    return replace(
        e,
        units=_units(e.units, repeats, k, whole),
        param_shards=whole["param_shards"],
        gradients=whole["gradients"],
        optimizer=whole["optimizer"],
        gathered_peak=whole["gathered_peak"],
        activations=whole["activations"],
        peak=whole["peak"],
        peak_at=peak_at,
        host=whole["host"],
        comm=comm,
        phases={key: whole[f"phases.{key}"] for key in e.phases},
        settings=settings,
    )


def _numbers(e: Estimate, repeats: Repeats, k: int) -> dict[str, int]:
    """The figures of a run of ``k`` blocks, by name; the units' other than the blocks (the
    root holds them all under no_shard)."""
    out = {f: getattr(e, f) for f in ("param_shards", "gradients", "optimizer", "gathered_peak", "activations", "peak", "host")}
    out.update({f"comm.{k}": v for k, v in e.comm.items() if k != "step_check"})
    out.update({f"phases.{k}": v for k, v in e.phases.items()})
    blocks = set(repeats.names(k))
    for u in e.units:
        if u.name not in blocks:
            out.update({f"unit.{u.name}.{f}": getattr(u, f) for f in ("params", "shard_bytes", "gathered_bytes")})
    return out


def _place(runs: list[Estimate], repeats: Repeats, k: int) -> str | None:
    """Where the whole model's peak is: the runs' place, its block counted from the first
    or from the last as it moves; None if the runs disagree."""
    pattern = re.compile(re.escape(repeats.path) + r"\.(\d+)")
    found = [pattern.search(e.peak_at) for e in runs]
    if not any(found):
        return runs[0].peak_at if len({e.peak_at for e in runs}) == 1 else None
    if not all(found) or len({pattern.sub("#", e.peak_at) for e in runs}) != 1:
        return None
    indices = [int(m.group(1)) for m in found]
    if len(set(indices)) == 1:
        index = indices[0]  # the same block from the first
    elif indices == [indices[0] + i for i in range(3)]:
        index = repeats.count - (k - indices[0])  # as many blocks from the last
    else:
        return None
    return pattern.sub(f"{repeats.path}.{index}", runs[0].peak_at)


def _units(rows: tuple[UnitRow, ...], repeats: Repeats, k: int, whole: dict[str, int]) -> tuple[UnitRow, ...]:
    """The whole model's unit table from a run of ``k`` blocks: each block's row alike, the
    other units' figures those of the whole."""
    first, blocks = f"{repeats.path}.0", set(repeats.names(k))
    out = []
    for u in rows:
        if u.name == first:
            out += [_renamed(u, repeats, n) for n in repeats.names(repeats.count)]
        elif u.name not in blocks:
            out.append(replace(u, **{f: whole[f"unit.{u.name}.{f}"] for f in ("params", "shard_bytes", "gathered_bytes")}))
    return tuple(out)


def _renamed(row: UnitRow, repeats: Repeats, name: str) -> UnitRow:
    first = f"{repeats.path}.0."
    owned = tuple((p.replace(first, name + ".", 1), r, b) for p, r, b in row.owned)
    return replace(row, name=name, owned=owned)
