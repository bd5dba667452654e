"""The budget search against real runs: for budgets from the smallest feasible peak to DDP's,
the chosen per-unit configuration, applied by ``shard(plan=...)``, peaks within the budget as
torch's MemTracker measures it, and within 3% of the prediction; a budget under the smallest
peak names it. On the built-in GPT (its loss inside) and a GPT of stock torch modules the
planner was never shaped on (its loss outside)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from test_plan import BATCH, MODELS, real_batch

import shardwise
from shardwise.tools import budget as search
from shardwise.tools import plan as P
from shardwise.tools.accounting import kept_buckets

WORLD = 2
SWEEP = 5  # budgets from the smallest feasible peak to DDP's


def planned(name: str) -> P.Plan:
    build, block, inputs, loss_fn = MODELS[name]
    return P.plan(
        build,
        world_size=WORLD,
        wrap=shardwise.wrap.by_class(block),
        batch_size=BATCH,
        inputs=inputs,
        loss=loss_fn,
        backend="gloo",
        budget="1GiB",
    )


def step(name, model, opt, loss_fn) -> None:
    """One training step (the batch made inside, as the planner's is: MemTracker counts it)."""
    x, y = real_batch(name, dist.get_rank())
    loss = loss_fn(model, x, y) if loss_fn else model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure_settings(name: str, settings_list) -> list[int]:
    """MemTracker's peak over a steady-state step of each configuration, as shard(plan=) applies it."""
    from torch.distributed._tools.mem_tracker import MemTracker

    build, _, _, loss_fn = MODELS[name]
    peaks = []
    for settings in settings_list:
        torch.manual_seed(0)
        model = shardwise.shard(build(), plan=settings)
        opt = torch.optim.AdamW(model.parameters())
        step(name, model, opt, loss_fn)
        tracker = MemTracker()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tracker.track_external(model, opt, *kept_buckets(model))
            with tracker:
                step(name, model, opt, loss_fn)
        peaks.append(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
    return peaks


@pytest.mark.parametrize("name", ["gpt", "mha"])
def test_budget_sweep_fits_and_predicts(pools, name):
    p = planned(name)
    smallest, ddp = search.needs(p.path[-1]), search.needs(p.path[0])
    budgets = [smallest + (ddp - smallest) * i // (SWEEP - 1) for i in range(SWEEP)]
    chosen = [search.choose(p.path, b)[0] for b in budgets]
    assert all(chosen)
    seconds = [s.seconds for s in chosen]
    assert seconds == sorted(seconds, reverse=True)  # a larger budget is never slower
    measured = pools(WORLD).run(measure_settings, name, [s.settings for s in chosen])[0]
    rows = []
    for b, s, m in zip(budgets, chosen, measured):
        e = s.estimate.peak
        rows.append(
            f"budget {b / 2**20:7.2f} MiB: {search.describe(s.settings):<60} predicted {e / 2**20:6.2f}, measured {m / 2**20:6.2f} MiB ({(e - m) / m:+.2%})"
        )
    print(f"\n{name} at N={WORLD}:", *(f"\n  {r}" for r in rows))
    for b, s, m in zip(budgets, chosen, measured):
        assert m <= b, (name, b, s.settings, m)
        assert abs(s.estimate.peak - m) <= 0.03 * m, (name, s.settings, s.estimate.peak, m)
    none, reason = search.choose(p.path, smallest - 1)
    assert (
        none is None
        and f"smallest peak possible is {p.path[-1].estimate.peak / 2**20:.2f} MiB" in reason
    )
    assert f"needs a budget of {smallest / 2**20:.2f} MiB" in reason
