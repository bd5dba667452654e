"""Buckets of small units under hybrid sharding: the same model bucketed and with every unit
alone, taking steps in turn in one run.

    torchrun --nproc_per_node 4 benchmarks/hybrid_buckets.py --shard-size 2

The model is ``shardwise bench --overhead``'s (``--units`` blocks of ``Linear(32, 32)`` +
``LayerNorm``, batch 4 rows per rank, SGD), sharded with ``wrap.by_class(Block)`` under
``--strategy`` (hybrid_shard) in shard groups of ``--shard-size`` ranks. Rank 0 prints each
system's median step time over ``--steps`` steps (after 3) and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import shardwise
from shardwise.bench.overhead import Block


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="hybrid_shard", choices=["hybrid_shard", "hybrid_shard_grad_op"])
    p.add_argument("--shard-size", type=int, default=2)
    p.add_argument("--units", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    systems = {}
    for name, bucket_bytes in (("alone", 0), ("bucketed", None)):
        torch.manual_seed(0)
        model = nn.Sequential(*[Block(32) for _ in range(a.units)])
        shardwise.shard(model, wrap=shardwise.wrap.by_class(Block), strategy=a.strategy, shard_size=a.shard_size)
        if bucket_bytes is not None:
            model._shardwise.bucket_bytes = bucket_bytes
        systems[name] = (model, torch.optim.SGD(model.parameters(), lr=0.01))
    x = torch.randn(4, 32)
    times: dict[str, list[float]] = {name: [] for name in systems}
    for step in range(3 + a.steps):
        for name, (model, opt) in systems.items():  # in turn: a disturbance falls on both
            dist.barrier()
            t0 = time.perf_counter()
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            dist.barrier()
            if step >= 3:
                times[name].append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(
            f"{a.strategy}, {dist.get_world_size() // a.shard_size}x{a.shard_size}, {a.units} units: "
            f"alone {ms['alone']:.1f} ms, bucketed {ms['bucketed']:.1f} ms, {ms['alone'] / ms['bucketed']:.2f}x"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
