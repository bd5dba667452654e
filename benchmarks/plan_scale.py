"""The planner at GPU scale on this CPU: Llama-2-7B and 70B-shaped configs, 64 ranks, NCCL, bf16.

    python benchmarks/plan_scale.py                      # both configs, blocks alike (the default)
    python benchmarks/plan_scale.py --whole              # every block run (repeats.FROM off)
    python benchmarks/plan_scale.py --configs llama-2-7b --strategy full_shard
    python benchmarks/plan_scale.py --configs llama-2-7b --budget 40GiB      # the budget search
    python benchmarks/plan_scale.py --configs llama-3-70b --world-size 512 --seq-len 8192 --budget 75GiB

For each config (benchmarks/configs/*/config.json, read as ``shardwise plan --hf`` reads it):
the seconds ``plan()`` took (wall, and this process's CPU: on a shared machine the wall clock
waits for the others), the exact parameter count against transformers' own, and the model
state against the theory, 16 bytes a parameter / N for bf16 compute with fp32 master weights,
fp32 gradients and AdamW's two fp32 moments; what the theory leaves out is named: padding rows
(a parameter's rows are split in N equal shares) and AdamW's 4-byte step counters. With
``--budget``: the seconds the budget search took, what it chose and its predicted peak.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from shardwise.core.wrap import auto
from shardwise.planner import repeats
from shardwise.planner.cli import hf_model
from shardwise.planner.plan import plan

CONFIGS = Path(__file__).resolve().parent / "configs"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="llama-2-7b,llama-2-70b")
    ap.add_argument("--world-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--strategy", help="one strategy (default: the three side by side, as the command)")
    ap.add_argument("--whole", action="store_true", help="run every block (no planning from a few)")
    ap.add_argument("--budget", help="the budget search for this memory per rank, e.g. 40GiB")
    a = ap.parse_args()
    if a.whole:
        repeats.FROM = 10**9
    rows = []
    for name in a.configs.split(","):
        _, build, _, batch = hf_model(str(CONFIGS / name), a.seq_len, 1)
        with torch.device("meta"):
            model = build()
        wrap = auto(model)
        wall, cpu = time.perf_counter(), time.process_time()
        p = plan(
            build, world_size=a.world_size, strategy=a.strategy, wrap=wrap, mixed_precision="bf16",
            inputs=batch, backend="nccl", budget=a.budget,
        )
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if a.budget is not None:
            print(f"\n{name}, {a.world_size} ranks, 1 x {a.seq_len} tokens, budget {a.budget}: plan "
                  f"{wall:.1f} s wall / {cpu:.1f} s CPU, {len(p.path)} steps on the path\n{p.reason}", flush=True)
            continue
        psi = model.num_parameters()
        e = p.estimates[0]
        theory = 16 * psi // a.world_size
        padding = sum(u.shard_bytes for u in e.units) // 4 * a.world_size - psi  # (fp32 shards)
        steps = sum(1 for _ in model.parameters()) * 4  # AdamW's step counter, one per shard
        rows.append((name, p, e, psi, theory, padding, steps, wall, cpu))
        print(p, flush=True)
    if a.budget is not None:
        return
    print(f"\n{a.world_size} ranks, nccl, bf16, 1 x {a.seq_len} tokens per rank{' (every block run)' if a.whole else ''}")
    print("| config | parameters (plan / transformers) | model state per rank | theory 16 B x params / N | difference | predicted peak (first column) | plan seconds (wall / CPU) |")
    print("|---|---|---|---|---|---|---|")
    for name, p, e, psi, theory, padding, steps, wall, cpu in rows:
        diff = e.model_state - theory
        print(
            f"| {name} | {p.parameters:,} / {psi:,} | {e.model_state:,} B | {theory:,} B | "
            f"{diff:+,} B (padding {padding:,} params x 16 B / N = {16 * padding // a.world_size:,}; "
            f"step counters {steps:,}) | {e.peak / 2**30:.2f} GiB at {e.peak_at} | {wall:.1f} / {cpu:.1f} |"
        )


if __name__ == "__main__":
    main()
