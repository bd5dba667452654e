"""The budget search: a per-unit configuration that fits a memory budget in the least
predicted step time.

The search walks one path from the fastest configuration to the smallest. It starts with
DDP (no_shard: nothing gathered, recomputed or offloaded), then shards parameters, gradients
and optimizer state with every unit kept gathered from forward to backward (shard_grad_op:
the same bytes sent per step as DDP's all-reduce, on a ring), then applies one per-unit move
at a time, the cheapest memory saving per predicted second first:

- reshard a unit after forward: it is gathered again for backward (one more all-gather of
  its parameters over the network) and frees them in between;
- recompute a unit (activation checkpointing): its forward again in backward, for the bytes
  its activations held; or selectively: keep its matrix products' and attention's outputs and
  recompute only the operations between (priced as one pass over its activations at the
  host copy rate, a stand-in for memory bandwidth, for an estimated half of their bytes);
- offload a unit's state (on a GPU only: on a CPU run host and device are one memory, Note
  [one memory] in plan.py): its shards, gradients and optimizer state cross the host link;
- offload a unit's activations (on a GPU only, likewise): what its forward saves crosses the
  host link out in forward and back in backward, for the bytes its activations held. A unit
  either recomputes its activations or offloads them: whichever is cheaper per byte comes
  first, and the other is then not tried (offload may still replace selective recomputation).

Savings are estimated to order the moves (gathered bytes; the unit's saved activations;
its state), each kind's scaled by what its last kept move really saved of its estimate; each
move is then re-planned with the real runtime on fake tensors, kept if the predicted peak went
down (by ``LEAST`` of it at least) and dropped if not. The path does not depend on the budget: every
budget takes the first configuration on it that fits, so a larger budget never gets a
slower one, and the last is the smallest peak possible with these moves; the search stops
at the first that fits (what follows is slower). A choice keeps a margin under the budget
(``MARGIN``).

Note [blocks decided together]: a move is made on a group of units, the blocks alike of a
model (one class, the same parameters: repeats.py) moved together and every other unit alone.
Every configuration on the path then treats the blocks alike, and is planned from runs of a
few of them (Note [blocks alike]): a 7B model's path costs what a handful of whole-model plans
did, where moving one block at a time cost a whole-model plan per block and kind (minutes).
The path's steps are coarser, so a budget refines the one it first fits (``refine``): the move
made on the first m blocks of the group only, m guessed by interpolating the peak between the
configuration it was made on and the step, and each guess planned whole with the real runtime
(a configuration that treats blocks differently is not alike), kept where it fits; an earlier
move on the group that this one overrides (selective recomputation under full) is then taken
back on as many of the other blocks as still fit (``_thinned``). Moving a
group can stop short of the smallest peak a move per unit reaches (offloading the last block's
activations saves nothing, as its backward comes first, but takes the place of recomputing it):
where nothing fits, a model planned whole (small) is searched again a unit a move (plan.py); a
model planned from a few blocks is not, as each such move is a whole-model plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from ..core.errors import ShardwiseError
from ..core.policies import Settings, Sharding, UnitConfig
from .costs import Rates

LEAST = 1e-3  # a move that lowers the peak by less than this share costs time for nothing


@dataclass(frozen=True)
class Step:
    """A configuration on the path, what it cost to get there and why."""

    settings: Settings
    estimate: object  # plan.Estimate (its peak and bytes sent)
    seconds: float  # predicted step time
    why: str
    # the move that made it (kind, the units moved together) and the estimate of the
    # configuration it was made on (``refine`` moves part of the group)
    move: tuple[str, tuple[str, ...]] | None = None
    before: object | None = None


@dataclass(frozen=True)
class Profile:
    """What the search knows of each unit before it moves any: by unit name."""

    forward_flops: dict[str, int]  # its module's forward, nested units included
    saved_bytes: dict[str, int]  # activations its forward saves for backward (not parameters)
    gathered_bytes: dict[str, int]
    shard_bytes: dict[str, int]


def seconds(settings: Settings, sent: int, profile: Profile, rates: Rates) -> float:
    """Predicted step time: forward and backward (three forwards), recomputation, the bytes
    the collectives send and the offloaded units' host traffic (shards in once per gather,
    gradients out; saved activations out and back)."""
    fwd = profile.forward_flops.get("", 0)
    recompute = sum(
        profile.forward_flops.get(n, 0) for n, c in settings.units if c.checkpoint == "full"
    )
    passes = sum(
        profile.saved_bytes.get(n, 0) for n, c in settings.units if c.checkpoint == "selective"
    )
    stashed = sum(
        2 * profile.saved_bytes.get(n, 0) for n, c in settings.units if c.offload_activations
    )
    host = sum(
        profile.shard_bytes.get(n, 0) * (3 if c.reshard_after_forward else 2)
        for n, c in settings.units
        if c.offload
    )
    return rates.seconds(flops=3 * fwd + recompute, host=host + passes + stashed, network=sent)


def path(
    together: Sequence[tuple[str, ...]],
    wrap,
    sharded: tuple[Sharding, Sharding],
    run: Callable[[Settings], object],
    profile_of: Callable[[Settings], tuple[object, Profile]],
    rates: Rates,
    *,
    world: int,
    offload: bool,
    budget: int | None = None,
    progress: Callable[[int], object] | None = None,
) -> tuple[list[Step], list[str], Profile]:
    """The path from DDP to the smallest configuration (see the module doc), the moves
    dropped on the way (they lowered nothing) and the units' profile. ``together``: the
    units of ``wrap`` in groups moved together (Note [blocks decided together]; one unit a
    group for a move per unit), innermost first, the root ("") last; ``sharded``: the
    strategies for every unit kept gathered and for some resharded (hybrid variants where
    planned so); ``run`` plans one configuration; ``profile_of`` plans one and profiles its
    units. With a ``budget`` the path stops at the first step that fits it (the rest are
    slower). ``progress(total)``: a progress bar (tqdm's ``update``, ``set_postfix_str`` and
    ``close``) over the configurations planned, or None."""
    names = [n for g in together for n in g]
    kept = Settings(
        sharded[0], wrap, tuple((n, UnitConfig(reshard_after_forward=False)) for n in names)
    )
    current, profile = profile_of(kept)
    ddp = Settings(Sharding.NO_SHARD, None, (("", UnitConfig(reshard_after_forward=False)),))
    e = run(ddp)
    steps = [
        Step(
            ddp,
            e,
            seconds(ddp, e.sent, profile, rates),
            "DDP: nothing gathered, recomputed or offloaded",
        )
    ]
    t = seconds(kept, current.sent, profile, rates)
    if current.peak < e.peak:
        why = f"shard parameters, gradients and optimizer state, every unit kept gathered to backward: {_delta(e, current, steps[0].seconds, t)}"
        steps.append(Step(kept, current, t, why))
    non_root = [g for g in together if "" not in g]
    moves = [(kind, g) for kind in ("reshard", "recompute", "selective") for g in non_root]
    moves += [(kind, g) for kind in ("offload", "offload activations") for g in together] if offload else []
    pricing = _Pricing(profile, rates, world)
    bar = progress(2 + len(moves)) if progress is not None else None
    try:
        dropped = _walk(steps, kept, current, moves, run, pricing, sharded, bar, budget)
    finally:
        if bar is not None:
            bar.close()
    return steps, dropped, profile


@dataclass
class _Pricing:
    """What a move is predicted to cost and save before it is planned, corrected by what the
    last kept move of its kind saved of its estimate (savings estimated from bytes held miss
    when those bytes are held)."""

    profile: Profile
    rates: Rates
    world: int
    learned: dict[str, float] = field(default_factory=dict)

    def estimate(self, move: tuple[str, tuple[str, ...]]) -> tuple[float, float]:
        """Predicted seconds a move adds and bytes it saves (on every unit of its group)."""
        kind, names = move
        each = [self._one(kind, n) for n in names]
        return sum(c for c, _ in each), sum(b for _, b in each)

    def _one(self, kind: str, n: str) -> tuple[float, float]:
        profile, rates = self.profile, self.rates
        if kind == "reshard":  # (one rank without a cast: the gathered parameters are the shard)
            gathered = profile.gathered_bytes[n]
            saved = gathered if self.world > 1 or gathered != profile.shard_bytes[n] else 0
            return rates.seconds(network=gathered * (self.world - 1) / self.world), saved
        if kind == "recompute":
            return rates.seconds(flops=profile.forward_flops.get(n, 0)), profile.saved_bytes.get(n, 0)
        if kind == "selective":
            return rates.seconds(host=profile.saved_bytes.get(n, 0)), profile.saved_bytes.get(n, 0) / 2
        if kind == "offload activations":  # out in forward, back in backward
            saved = profile.saved_bytes.get(n, 0)
            return rates.seconds(host=2 * saved), saved
        # shards in at each gather, gradients out; shards, gradients and Adam's two moments saved
        return rates.seconds(host=3 * profile.shard_bytes[n]), 4 * profile.shard_bytes[n]

    def price(self, move: tuple[str, tuple[str, ...]]) -> float:
        """Predicted seconds per byte saved: the cheapest is tried next."""
        cost, saved = self.estimate(move)
        return cost / (saved * self.learned.get(move[0], 1.0))


def _walk(steps, settings, current, moves, run, pricing: _Pricing, sharded, bar, budget) -> list[str]:
    """Try the moves cheapest first, each on top of those kept; a move is kept when it lowers
    the peak, and becomes a step of the path when it goes below the last step's, until one
    fits ``budget`` (None: to the end). Returns the moves dropped, with why."""
    dropped = []
    remaining = [m for m in moves if pricing.estimate(m)[1] > 0]  # (saving nothing: not tried)
    if bar is not None:
        bar.update(2 + len(moves) - len(remaining))  # (DDP, sharded, the moves not tried)
    while remaining and (budget is None or needs(steps[-1]) > budget):
        if bar is not None:
            bar.set_postfix_str(f"best peak {_fmt(steps[-1].estimate.peak)}", refresh=False)
            bar.update(1)
        move = min(remaining, key=pricing.price)
        remaining.remove(move)
        kind, names = move
        c = settings.of(names[0])  # (a group's units are moved together: set alike)
        if kind in ("recompute", "selective", "offload activations") and (
            c.checkpoint == "full" or c.offload_activations
        ):
            continue  # (its activations are recomputed or offloaded already)
        trial = _moved(settings, kind, names, sharded)
        label = f"{kind} {_names(names)}"
        try:
            e = run(trial)
        except ShardwiseError as exc:  # a configuration the model cannot run is not on the path
            dropped.append(f"{label} fails: {exc}")
            continue
        if e.peak > current.peak * (1 - LEAST):
            dropped.append(f"{label} lowers nothing ({_fmt(e.peak)})")
            continue
        pricing.learned[kind] = (current.peak - e.peak) / pricing.estimate(move)[1]
        t_new = seconds(trial, e.sent, pricing.profile, pricing.rates)
        if e.peak < steps[-1].estimate.peak:
            why = f"{label}: {_delta(steps[-1].estimate, e, steps[-1].seconds, t_new)}"
            steps.append(Step(trial, e, t_new, why, move, current))
        settings, current = trial, e
    if bar is not None:
        bar.set_postfix_str(f"best peak {_fmt(steps[-1].estimate.peak)}")
    return dropped


def refine(
    steps: list[Step],
    budget: int,
    run: Callable[[Settings], object],
    timed: Callable[[Settings, object], float],
    sharded: tuple[Sharding, Sharding],
    *,
    tries: int | None = None,
) -> list[Step]:
    """The path with one more step where ``budget`` first fits a step made by moving a group
    of units: the same move on the group's first m units only, for the least m that fits
    (Note [blocks decided together]). Each guess of m interpolates the peak between the
    nearest m known not to fit and known to fit, and is planned with ``run``; ``timed``
    predicts a configuration's step time from its estimate; ``tries``: guesses at most
    (None: until the least m is found)."""
    i = next((i for i, s in enumerate(steps) if needs(s) <= budget), None)
    if not i or steps[i].move is None or len(steps[i].move[1]) < 2:
        return steps
    (kind, group), before = steps[i].move, steps[i].before
    lo, hi = (0, before.peak), (len(group), steps[i].estimate.peak)  # (m, peak): no fit, fit
    target = budget / (1 + MARGIN)
    found, left = None, tries
    while hi[0] - lo[0] > 1 and left != 0:
        left = None if left is None else left - 1
        share = (lo[1] - target) / max(1, lo[1] - hi[1])
        m = min(hi[0] - 1, max(lo[0] + 1, lo[0] + math.ceil((hi[0] - lo[0]) * share)))
        trial = _moved(before.settings, kind, group[:m], sharded)
        try:
            e = run(trial)
        except ShardwiseError:  # (as on the path: a configuration the model cannot run)
            break
        if math.ceil(e.peak * (1 + MARGIN)) <= budget:
            hi, found = (m, e.peak), (trial, e)
        else:
            lo = (m, e.peak)
    if found is None:
        return steps
    trial, e, back = _thinned(steps[:i], kind, group, hi[0], found, run, budget, tries)
    t = timed(trial, e)
    why = (
        f"{kind} {_names(group[: hi[0]])} ({hi[0]} of {len(group)}, for the budget{back}): "
        f"{_delta(steps[i - 1].estimate, e, steps[i - 1].seconds, t)}"
    )
    return [*steps[:i], Step(trial, e, t, why, (kind, group[: hi[0]]), before), *steps[i:]]


def _thinned(steps, kind, group, m, found, run, budget, tries) -> tuple[Settings, object, str]:
    """``found`` (the move on the group's first ``m`` units) with the last earlier move on the
    same group that it overrides (another kind setting the same fields: selective recomputation
    under full) taken back on as many of the group's other units as still fits: the group moved
    alike needed it everywhere, the refined configuration may not, where a move per unit would
    not have made it."""
    fields = set(_CHANGES[kind])
    earlier = next(
        (s for s in reversed(steps) if s.move and s.move[0] != kind and s.move[1] == group and fields & set(_CHANGES[s.move[0]])),
        None,
    )
    if earlier is None or m == len(group):
        return (*found, "")
    tail, (lo, hi) = group[m:][::-1], (0, len(group) - m + 1)  # (k undone: fits, does not)
    while hi - lo > 1 and tries != 0:
        tries = None if tries is None else tries - 1
        k = (lo + hi) // 2
        trial = _undone(found[0], earlier.move[0], tail[:k], earlier.before.settings)
        try:
            e = run(trial)
        except ShardwiseError:
            break
        if math.ceil(e.peak * (1 + MARGIN)) <= budget:
            lo, found = k, (trial, e)
        else:
            hi = k
    return (*found, f"; {earlier.move[0]} taken back on {_names([n for n in group if n in tail[:lo]])}" if lo else "")


def _names(names: Sequence[str]) -> str:
    """Units in a few words: one, or a run of blocks ``model.layers.{0..31}``."""
    if len(names) == 1:
        return names[0] or "<root>"
    stem, _, first = names[0].rpartition(".")
    last = names[-1].rpartition(".")[2]
    return f"{stem}.{{{first}..{last}}}" if stem else ", ".join(n or "<root>" for n in names)


def _moved(settings: Settings, kind: str, names: Sequence[str], sharded: tuple[Sharding, Sharding]) -> Settings:
    """``settings`` with some units' setting changed."""
    units = tuple((n, replace(c, **_CHANGES[kind]) if n in names else c) for n, c in settings.units)
    strategy = sharded[1] if any(c.reshard_after_forward for _, c in units) else sharded[0]
    return Settings(strategy, settings.wrap, units)


def _undone(settings: Settings, kind: str, names: Sequence[str], base: Settings) -> Settings:
    """``settings`` with a move of ``kind`` taken back on some units: what the move changes set
    as ``base`` had it."""
    units = tuple(
        (n, replace(c, **{f: getattr(base.of(n), f) for f in _CHANGES[kind]}) if n in names else c)
        for n, c in settings.units
    )
    return Settings(settings.strategy, settings.wrap, units)


_CHANGES = {
    "reshard": {"reshard_after_forward": True},
    "recompute": {"checkpoint": "full"},
    "selective": {"checkpoint": "selective"},
    "offload": {"offload": True},
    "offload activations": {"checkpoint": "none", "offload_activations": True},
}


# the headroom a choice keeps under the budget: the planner's peaks matched MemTracker's to
# within bytes on CPU (docs/tools.md), but a prediction is not a measurement
MARGIN = 0.01


def needs(step: Step) -> int:
    """The smallest budget ``step`` is chosen for: its predicted peak and the margin."""
    return math.ceil(step.estimate.peak * (1 + MARGIN))


def choose(steps: list[Step], budget: int, at: str = "") -> tuple[Step | None, str]:
    """The first step of the path that fits ``budget`` with the margin (the fastest that
    does), and why (``at``: the rates its step time is priced at)."""
    for i, s in enumerate(steps):
        if needs(s) <= budget:
            share = f"{100 * s.estimate.peak / budget:.0f}%"
            why = (
                f"{describe(s.settings)}: predicted peak {_fmt(s.estimate.peak)} of {_fmt(budget)} ({share}), "
                f"predicted step {1e3 * s.seconds:.1f} ms" + (f" (at {at})" if at else "")
            )
            if i:
                why += ". Faster configurations do not fit: " + "; ".join(
                    f"{describe(f.settings)} needs {_fmt(f.estimate.peak)}"
                    for f in steps[max(0, i - 3) : i]
                )
            return s, why
    best = steps[-1]
    return None, (
        f"nothing fits {_fmt(budget)}: the smallest peak possible is {_fmt(best.estimate.peak)} "
        f"({describe(best.settings)}), which needs a budget of {_fmt(needs(best))} with the "
        f"{MARGIN:.0%} margin. Lower the micro-batch, use more ranks, or use mixed precision."
    )


def describe(settings: Settings) -> str:
    """A configuration in a few words: the strategy, then how many units do what."""
    if not settings.strategy.shard:
        return f"{settings.strategy} (DDP)"
    units = [c for n, c in settings.units if n]
    parts = [f"{settings.strategy}"]
    if units:
        parts.append(
            f"{sum(c.reshard_after_forward for c in units)}/{len(units)} units resharded after forward"
        )
    for what, count in (
        ("recomputed", sum(c.checkpoint == "full" for c in units)),
        ("recomputed selectively", sum(c.checkpoint == "selective" for c in units)),
        ("offloaded", sum(c.offload for _, c in settings.units)),
        ("with activations offloaded", sum(c.offload_activations for _, c in settings.units)),
    ):
        if count:
            parts.append(f"{count} {what}")
    return ", ".join(parts)


def table(settings: Settings) -> list[str]:
    """The per-unit table of a configuration."""
    lines = [
        f"  {'unit':<28}{'reshard after fwd':>18}{'checkpoint':>12}{'offload':>9}"
        f"{'offload activations':>21}"
    ]
    for n, c in settings.units:
        lines.append(
            f"  {n or '<root>':<28}{'yes' if c.reshard_after_forward else 'no':>18}{c.checkpoint:>12}"
            f"{'yes' if c.offload else 'no':>9}{'yes' if c.offload_activations else 'no':>21}"
        )
    return lines


def _delta(before, after, t0: float, t1: float) -> str:
    return (
        f"peak {_fmt(before.peak)} -> {_fmt(after.peak)}, step {1e3 * t0:.1f} -> {1e3 * t1:.1f} ms"
    )


def _fmt(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
