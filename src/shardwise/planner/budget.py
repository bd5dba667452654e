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
slower one, and the last is the smallest peak possible with these moves. A choice keeps a
margin under the budget (``MARGIN``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..errors import ShardwiseError
from ..policies import Settings, Sharding, UnitConfig
from .costs import Rates

LEAST = 1e-3  # a move that lowers the peak by less than this share costs time for nothing


@dataclass(frozen=True)
class Step:
    """A configuration on the path, what it cost to get there and why."""

    settings: Settings
    estimate: object  # plan.Estimate (its peak and bytes sent)
    seconds: float  # predicted step time
    why: str


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
    names: list[str],
    wrap,
    sharded: tuple[Sharding, Sharding],
    run: Callable[[Settings], object],
    profile_of: Callable[[Settings], tuple[object, Profile]],
    rates: Rates,
    *,
    world: int,
    offload: bool,
) -> tuple[list[Step], list[str]]:
    """The path from DDP to the smallest configuration (see the module doc), and the moves
    dropped on the way (they lowered nothing). ``names``: the units of ``wrap``, innermost
    first, the root ("") last; ``sharded``: the strategies for every unit kept gathered
    and for some resharded (hybrid variants where planned so); ``run`` plans one
    configuration; ``profile_of`` plans one and profiles its units."""
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
    non_root = [n for n in names if n]
    moves = [(kind, n) for kind in ("reshard", "recompute", "selective") for n in non_root]
    moves += [(kind, n) for kind in ("offload", "offload activations") for n in names] if offload else []
    dropped = _walk(steps, kept, current, moves, run, _Pricing(profile, rates, world), sharded)
    return steps, dropped


@dataclass
class _Pricing:
    """What a move is predicted to cost and save before it is planned, corrected by what the
    last kept move of its kind saved of its estimate (savings estimated from bytes held miss
    when those bytes are held)."""

    profile: Profile
    rates: Rates
    world: int
    learned: dict[str, float] = field(default_factory=dict)

    def estimate(self, move: tuple[str, str]) -> tuple[float, float]:
        """Predicted seconds a move adds and bytes it saves."""
        kind, n = move
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

    def price(self, move: tuple[str, str]) -> float:
        """Predicted seconds per byte saved: the cheapest is tried next."""
        cost, saved = self.estimate(move)
        return cost / (saved * self.learned.get(move[0], 1.0))


def _walk(steps, settings, current, moves, run, pricing: _Pricing, sharded) -> list[str]:
    """Try the moves cheapest first, each on top of those kept; a move is kept when it lowers
    the peak, and becomes a step of the path when it goes below the last step's. Returns the
    moves dropped, with why."""
    dropped = []
    remaining = [m for m in moves if pricing.estimate(m)[1] > 0]  # (saving nothing: not tried)
    while remaining:
        kind, n = min(remaining, key=pricing.price)
        remaining.remove((kind, n))
        c = settings.of(n)
        if kind in ("recompute", "selective", "offload activations") and (
            c.checkpoint == "full" or c.offload_activations
        ):
            continue  # (its activations are recomputed or offloaded already)
        trial = _moved(settings, kind, n, sharded)
        label = f"{kind} {n or '<root>'}"
        try:
            e = run(trial)
        except ShardwiseError as exc:  # a configuration the model cannot run is not on the path
            dropped.append(f"{label} fails: {exc}")
            continue
        if e.peak > current.peak * (1 - LEAST):
            dropped.append(f"{label} lowers nothing ({_fmt(e.peak)})")
            continue
        pricing.learned[kind] = (current.peak - e.peak) / pricing.estimate((kind, n))[1]
        t_new = seconds(trial, e.sent, pricing.profile, pricing.rates)
        if e.peak < steps[-1].estimate.peak:
            why = f"{label}: {_delta(steps[-1].estimate, e, steps[-1].seconds, t_new)}"
            steps.append(Step(trial, e, t_new, why))
        settings, current = trial, e
    return dropped


def _moved(settings: Settings, kind: str, name: str, sharded: tuple[Sharding, Sharding]) -> Settings:
    """``settings`` with one unit's setting changed."""
    change = {
        "reshard": {"reshard_after_forward": True},
        "recompute": {"checkpoint": "full"},
        "selective": {"checkpoint": "selective"},
        "offload": {"offload": True},
        "offload activations": {"checkpoint": "none", "offload_activations": True},
    }
    units = tuple((n, replace(c, **change[kind]) if n == name else c) for n, c in settings.units)
    strategy = sharded[1] if any(c.reshard_after_forward for _, c in units) else sharded[0]
    return Settings(strategy, settings.wrap, units)


# the headroom a choice keeps under the budget: the planner's peaks matched MemTracker's to
# within bytes on CPU (docs/tools.md), but a prediction is not a measurement
MARGIN = 0.01


def needs(step: Step) -> int:
    """The smallest budget ``step`` is chosen for: its predicted peak and the margin."""
    return math.ceil(step.estimate.peak * (1 + MARGIN))


def choose(steps: list[Step], budget: int) -> tuple[Step | None, str]:
    """The first step of the path that fits ``budget`` with the margin (the fastest that
    does), and why."""
    for i, s in enumerate(steps):
        if needs(s) <= budget:
            share = f"{100 * s.estimate.peak / budget:.0f}%"
            why = (
                f"{describe(s.settings)}: predicted peak {_fmt(s.estimate.peak)} of {_fmt(budget)} ({share}), "
                f"predicted step {1e3 * s.seconds:.1f} ms"
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
