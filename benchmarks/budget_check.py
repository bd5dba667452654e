"""The budget planner against real runs: peaks, step times, and activation offload.

    python benchmarks/budget_check.py "$OUT"                 # one GPU: world size 1, NCCL
    python benchmarks/budget_check.py /tmp/bc --cpu          # two CPU ranks, Gloo

The small GPT, fp32, AdamW; on the GPU 8 x 1024 tokens, on CPU 4 x 64 tokens per rank.
1. The planner's path (planner/budget.py): on the GPU with offload of units' state and of their
   activations as moves (two memories), on CPU without (one memory).
2. A sweep of five budgets from the smallest feasible to DDP's: the chosen configuration is
   applied by ``shard(plan=...)`` and its peak over a steady-state step measured (the
   device allocator's ``max_memory_allocated`` on CUDA, with ``max_memory_reserved`` beside it:
   what the caching allocator adds; torch's MemTracker on CPU) against
   the budget and the prediction; its median step time against the fastest configuration
   that fits the budget among every configuration measured (the path, and a uniform grid:
   every unit resharded or none, recomputed or none, and on the GPU offloaded or not,
   activations offloaded or not).
3. On the GPU, activation offload (every block) against none: the same losses (the copies
   are exact), the device peak and the step time.
Prints the tables and writes budget_check.json to the directory given.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import shardwise
from shardwise.core import groups
from shardwise.core.policies import Settings, UnitConfig
from shardwise.job.models import GPT, Block, gpt_config
from shardwise.planner import budget as search
from shardwise.planner import plan as P

STEPS = 6  # timed steps after two warm-up steps


def measure(settings: Settings, cuda: bool, cfg, batch: int) -> dict:
    """Peak bytes of a steady-state step, median step ms and the losses (on CPU, this rank's
    peak under MemTracker, over the second step)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from shardwise.observer.accounting import kept_buckets

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    shardwise.shard(model, plan=settings)
    offloaded = any(c.offload for _, c in settings.units)
    opt = torch.optim.AdamW(model.parameters(), **({"fused": True} if offloaded else {}))
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    losses, times, peak = [], [], 0
    for step in range(2 + STEPS):
        x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
        x = x.cuda() if cuda else x
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        tracker = MemTracker() if step == 1 and not cuda else None
        if tracker is not None:
            tracker.track_external(model, opt, *kept_buckets(model))
        t0 = time.perf_counter()
        with tracker or contextlib.nullcontext(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if step == 1:
            peak = (
                torch.cuda.max_memory_allocated()
                if cuda
                else tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
            )
            # what the caching allocator adds: its segments' peak over the tensors' (rounding to
            # 512 B blocks and 2 MiB segments, fragmentation); the CUDA context and NCCL's and
            # cuBLAS's workspaces are in neither
            reserved = torch.cuda.max_memory_reserved() if cuda else None
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    return {"peak": peak, "reserved": reserved, "ms": 1e3 * statistics.median(times[2:]), "losses": losses}


def uniform(
    names: list[str], reshard: bool, recompute: bool, offload: bool, activations: bool
) -> Settings:
    return Settings(
        "full_shard" if reshard else "shard_grad_op",
        shardwise.wrap.by_class(Block),
        tuple(
            (
                n,
                UnitConfig(
                    reshard_after_forward=reshard and bool(n),
                    checkpoint="full" if recompute and n else "none",
                    offload=offload,
                    offload_activations=activations and bool(n) and not recompute,
                ),
            )
            for n in names
        ),
    )


def run(out: Path, cuda: bool) -> None:
    """One rank: plan (rank 0 plans for all), measure every configuration, report on rank 0."""
    os.environ.setdefault("SHARDWISE_CACHE", str(out / "cache"))
    shardwise.init()
    torch.set_num_threads(1 if not cuda else torch.get_num_threads())
    cfg, batch = (
        (gpt_config("small", seq_len=1024), 8) if cuda else (gpt_config("small", seq_len=64), 4)
    )
    rank0 = dist.get_rank() == 0
    t0 = time.perf_counter()
    p = P.plan(
        functools.partial(GPT, cfg),
        world_size=dist.get_world_size(),
        wrap=shardwise.wrap.by_class(Block),
        batch_size=batch,
        backend="nccl" if cuda else "gloo",
        budget="1TiB",
    )
    plan_s = time.perf_counter() - t0
    if rank0:
        print(p, f"\nplanned in {plan_s:.1f} s", flush=True)
    names = [n for n, _ in p.path[-1].settings.units]
    configs = {f"path {i}": s.settings for i, s in enumerate(p.path)}
    for rs, r, o, a in itertools.product([False, True], repeat=4):
        if not (r and a) and (cuda or not (o or a)):
            configs[
                f"grid reshard={int(rs)} recompute={int(r)} offload={int(o)} act_offload={int(a)}"
            ] = uniform(names, rs, r, o, a)
    measured = {}
    # two passes, the second in reverse order, each configuration's faster median kept: the
    # first runs of a process (and a shared machine's load) otherwise weigh on whichever is first
    for label in [*configs, *reversed(configs)]:
        m = measure(configs[label], cuda, cfg, batch)
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, m["peak"])
        m["peak"] = max(peaks)  # the largest rank's, as the plan predicts rank 0's (equal here)
        if label in measured:
            m["ms"] = min(m["ms"], measured[label]["ms"])
        measured[label] = m
    if rank0:
        for label, m in measured.items():
            print(
                f"{label:<52} peak {m['peak'] / 2**20:9.2f} MiB  step {m['ms']:7.1f} ms", flush=True
            )
    if not rank0:
        return
    smallest, ddp = search.needs(p.path[-1]), search.needs(p.path[0])
    rows = []
    for i in range(5):
        b = smallest + (ddp - smallest) * i // 4
        step, _ = search.choose(p.path, b)
        label = f"path {p.path.index(step)}"
        m = measured[label]
        fits = [(v["ms"], k) for k, v in measured.items() if v["peak"] <= b]
        best_ms, best = min(fits)
        rows.append(
            {
                "budget": b,
                "chosen": label,
                "what": search.describe(step.settings),
                "predicted": step.estimate.peak,
                "measured": m["peak"],
                "reserved": m["reserved"],
                "ms": m["ms"],
                "fastest_fitting": best,
                "fastest_ms": best_ms,
            }
        )
        allocator = (
            f", reserved {m['reserved'] / 2**20:.1f} MiB (the allocator adds {(m['reserved'] - m['peak']) / 2**20:.1f})"
            if m["reserved"] is not None
            else ""
        )
        print(
            f"budget {b / 2**20:9.1f} MiB: {label} ({search.describe(step.settings)}) predicted "
            f"{step.estimate.peak / 2**20:.1f}, measured {m['peak'] / 2**20:.1f} MiB "
            f"({(step.estimate.peak - m['peak']) / m['peak']:+.2%}){allocator}, fits: {m['peak'] <= b}; "
            f"{m['ms']:.1f} ms vs fastest fitting {best} {best_ms:.1f} ms ({m['ms'] / best_ms - 1:+.1%})",
            flush=True,
        )
    same = None
    if cuda:
        kept = measured["grid reshard=0 recompute=0 offload=0 act_offload=0"]
        act = measured["grid reshard=0 recompute=0 offload=0 act_offload=1"]
        same = kept["losses"] == act["losses"]
        print(
            f"activation offload: losses identical {same} ({act['losses'][:3]}...), peak "
            f"{kept['peak'] / 2**20:.1f} -> {act['peak'] / 2**20:.1f} MiB, step {kept['ms']:.1f} -> {act['ms']:.1f} ms"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "budget_check.json").write_text(
        json.dumps(
            {
                "plan_s": plan_s,
                "plan": str(p),
                "measured": measured,
                "sweep": rows,
                "activation_offload_exact": same,
            },
            indent=1,
        )
    )


def main() -> None:
    out, cuda = Path(sys.argv[1]), "--cpu" not in sys.argv
    if cuda:
        run(out, cuda)
    else:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        groups.launch_local(2, run, out, cuda)


if __name__ == "__main__":
    main()
