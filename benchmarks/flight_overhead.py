"""What the always-on divergence guard costs per step: the flight recorder and the step check.

    python benchmarks/flight_overhead.py --nproc 2 --steps 12

Local ranks (Gloo), the small GPT wrapped per block, 4 x 128 tokens per rank, AdamW, one
intra-op thread. Per rank it measures the median step time, the collectives recorded per
step, the cost of one ``flight.record`` call (a tight loop of 20,000), and the time spent in
the step check (``comm_stats()["step_check"].seconds``); the guard's share of a step is
(records x cost + check time) / step time. Prints one row per rank.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def rank_main(steps: int) -> dict:
    import shardwise
    from shardwise.core import flight, groups
    from shardwise.job.data import get_batch, rank_slice
    from shardwise.job.models import GPT, Block, gpt_config

    groups.init()
    torch.set_num_threads(1)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = shardwise.shard(GPT(gpt_config("small", seq_len=128)), wrap=shardwise.wrap.by_class(Block))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, records = [], []
    for step in range(steps + 2):
        x, y = get_batch(step, 4 * world, 128)
        if step == 2:
            shardwise.reset_comm_stats()
        seq0, t0 = flight._seq, time.perf_counter()
        model(rank_slice(x, rank, world), rank_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        if step >= 2:  # the first steps learn the order and build the optimizer state
            times.append(time.perf_counter() - t0)
            records.append(flight._seq - seq0)
    check = shardwise.comm_stats()["step_check"]
    n = 20_000
    t0 = time.perf_counter()
    for i in range(n):
        flight.record("all_gather", "blocks.3", 4096 + i % 7, torch.float32)
    record_s = (time.perf_counter() - t0) / n
    step_s = statistics.median(times)
    per_step = statistics.median(records)
    guard_s = per_step * record_s + check.seconds / max(check.calls, 1)
    return {
        "rank": rank,
        "step_ms": 1e3 * step_s,
        "records": per_step,
        "record_us": 1e6 * record_s,
        "check_ms": 1e3 * check.seconds / max(check.calls, 1),
        "share": guard_s / step_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args()
    from shardwise.core.groups import launch_local

    rows = launch_local(a.nproc, rank_main, a.steps)
    print("| rank | step ms | collectives recorded per step | us per record | step check ms | guard share of step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in sorted(rows.values(), key=lambda r: r["rank"]):
        print(
            f"| {r['rank']} | {r['step_ms']:.1f} | {r['records']:.0f} | {r['record_us']:.2f} | "
            f"{r['check_ms']:.2f} | {100 * r['share']:.2f}% |"
        )


if __name__ == "__main__":
    main()
