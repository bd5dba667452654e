"""One-GPU check of the budget planner and of activation offload on CUDA.

    python benchmarks/budget_check.py "$OUT"

On one GPU (world size 1, NCCL), the small GPT at 8 x 1024 tokens, fp32, AdamW:
1. The planner's path (tools/budget.py), with offload of units' state and activation
   checkpointing as moves (the device and the host are two memories here).
2. A sweep of five budgets from the smallest feasible to DDP's: the chosen configuration is
   applied by ``shard(plan=...)`` and its peak ``torch.cuda.max_memory_allocated`` over a
   steady-state step measured against the budget and the prediction; its median step time
   against the fastest configuration that fits the budget among every configuration
   measured (the path, and the uniform grid of recompute x offload x activation offload).
3. Activation offload (every block, ``UnitConfig(offload_activations=True)``) against none:
   the same losses over the steps (the copies are exact), the device peak and the step time.
Prints the tables and writes budget_check.json to the directory given.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import shardwise
from shardwise.models import GPT, Block, gpt_config
from shardwise.policies import Settings, UnitConfig
from shardwise.tools import budget as search
from shardwise.tools import plan as P

CFG = gpt_config("small", seq_len=1024)
BATCH = 8
STEPS = 6  # timed steps after two warm-up steps


def measure(settings: Settings) -> dict:
    """Peak device bytes of a steady-state step, median step ms and the losses."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(CFG)
    shardwise.shard(model, plan=settings)
    offloaded = any(c.offload for _, c in settings.units)
    opt = torch.optim.AdamW(model.parameters(), **({"fused": True} if offloaded else {}))
    g = torch.Generator().manual_seed(1)
    losses, times, peak = [], [], 0
    for step in range(2 + STEPS):
        x = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len + 1), generator=g).cuda()
        if step == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if step == 1:
            peak = torch.cuda.max_memory_allocated()
    del model, opt
    torch.cuda.empty_cache()
    return {"peak": peak, "ms": 1e3 * statistics.median(times[2:]), "losses": losses}


def uniform(names: list[str], recompute: bool, offload: bool, activations: bool) -> Settings:
    return Settings("shard_grad_op", shardwise.wrap.by_class(Block), tuple(
        (n, UnitConfig(reshard_after_forward=False, checkpoint="full" if recompute and n else "none",
                       offload=offload, offload_activations=activations and bool(n) and not recompute))
        for n in names
    ))


def main(out: Path) -> None:
    os.environ.setdefault("SHARDWISE_CACHE", str(out / "cache"))
    shardwise.init()
    t0 = time.perf_counter()
    p = P.plan(functools.partial(GPT, CFG), world_size=1, wrap=shardwise.wrap.by_class(Block),
               batch_size=BATCH, backend="nccl", budget="1TiB")
    plan_s = time.perf_counter() - t0
    print(p, f"\nplanned in {plan_s:.1f} s", flush=True)
    names = [n for n, _ in p.path[-1].settings.units]
    configs = {f"path {i}": s.settings for i, s in enumerate(p.path)}
    for r, o, a in itertools.product([False, True], repeat=3):
        if not (r and a):
            configs[f"grid recompute={int(r)} offload={int(o)} act_offload={int(a)}"] = uniform(names, r, o, a)
    measured = {}
    for label, settings in configs.items():
        measured[label] = measure(settings)
        m = measured[label]
        print(f"{label:<44} peak {m['peak'] / 2**20:9.1f} MiB  step {m['ms']:7.1f} ms", flush=True)
    smallest, ddp = search.needs(p.path[-1]), search.needs(p.path[0])
    rows = []
    for i in range(5):
        b = smallest + (ddp - smallest) * i // 4
        step, _ = search.choose(p.path, b)
        label = f"path {p.path.index(step)}"
        m = measured[label]
        fits = [(v["ms"], k) for k, v in measured.items() if v["peak"] <= b]
        best_ms, best = min(fits)
        rows.append({
            "budget": b, "chosen": label, "what": search.describe(step.settings),
            "predicted": step.estimate.peak, "measured": m["peak"], "ms": m["ms"],
            "fastest_fitting": best, "fastest_ms": best_ms,
        })
        print(f"budget {b / 2**20:9.1f} MiB: {label} ({search.describe(step.settings)}) predicted "
              f"{step.estimate.peak / 2**20:.1f}, measured {m['peak'] / 2**20:.1f} MiB "
              f"({(step.estimate.peak - m['peak']) / m['peak']:+.2%}), fits: {m['peak'] <= b}; "
              f"{m['ms']:.1f} ms vs fastest fitting {best} {best_ms:.1f} ms ({m['ms'] / best_ms - 1:+.1%})",
              flush=True)
    kept, act = measured["grid recompute=0 offload=0 act_offload=0"], measured["grid recompute=0 offload=0 act_offload=1"]
    same = kept["losses"] == act["losses"]
    print(f"activation offload: losses identical {same} ({act['losses'][:3]}...), peak "
          f"{kept['peak'] / 2**20:.1f} -> {act['peak'] / 2**20:.1f} MiB, step {kept['ms']:.1f} -> {act['ms']:.1f} ms")
    (out / "budget_check.json").write_text(json.dumps(
        {"plan_s": plan_s, "plan": str(p), "measured": measured, "sweep": rows, "activation_offload_exact": same},
        indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
