"""What a unit's own operations cost at N=1 under a cast, one call at a time (docs/benchmarks.md,
"a one-rank unit computes on its shard parameters").

    python benchmarks/one_rank_costs.py --mixed-precision bf16

One process (a Gloo group of one), the overhead benchmark's ``Block`` wrapped as a unit; each
line is the mean of a tight loop of ``--calls`` calls on that unit, in µs: its gather and
reshard, their parts (allocating and freeing the compute copy, the casting copy, the flight
record of a gather over a group of one), the view and node hook that mark the end of a unit's
backward, and one gradient's cast to the reduction dtype. The last two lines price the way
around the casts that docs/benchmarks.md weighs (seventh session): each of the unit's
parameters cast inside the autograd graph (so that autograd casts the gradients back), and
those casts' storage freed after forward and refilled for backward, as full_shard would need.
"""

from __future__ import annotations

import argparse
import os
import timeit

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mixed-precision", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--calls", type=int, default=20_000)
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29613")
    torch.set_num_threads(1)
    import shardwise
    from shardwise.bench.overhead import Block
    from shardwise.core import collectives

    dist.init_process_group("gloo", rank=0, world_size=1)
    model = shardwise.shard(nn.Sequential(Block(32), Block(32)), wrap=shardwise.wrap.by_class(Block),
                            mixed_precision=args.mixed_precision)
    unit = next(u for u in shardwise.units(model) if u.name == "0")
    x = torch.randn(4, 32, requires_grad=True)
    grad = torch.randn(32, 32, dtype=unit.compute_dtype)

    def mark_end():
        x.view_as(x).grad_fn.register_prehook(lambda grads: None)

    costs = {
        "gather and reshard": lambda: (unit.wait_unshard(), unit.reshard()),
        "allocate and free the compute copy": lambda: (unit._allocate_full(), unit._free_full()),
        "flight record of the local gather": lambda: collectives.book_alone(
            "all_gather", unit.label, unit.flat_shard.numel(), unit.compute_dtype),
        "view and node hook (end of backward)": mark_end,
        "one gradient's cast": lambda: grad.to(unit.reduce_dtype),
    }
    params = unit.shard_params
    casts = [p.detach().to(unit.compute_dtype) for p in params]

    def free_and_refill():
        for c, p in zip(casts, params):
            c.untyped_storage().resize_(0)
            c.untyped_storage().resize_(c.numel() * c.element_size())
            c.copy_(p.detach())

    costs["the parameters cast in the graph"] = lambda: [p.to(unit.compute_dtype) for p in params]
    costs["those casts freed and refilled"] = free_and_refill
    for name, fn in costs.items():
        print(f"{name:40s} {timeit.timeit(fn, number=args.calls) / args.calls * 1e6:6.2f} µs")
    unit._allocate_full()  # (the copy needs the compute copy's storage)
    cast = timeit.timeit(lambda: unit._flat_full_data.copy_(unit.flat_shard), number=args.calls)
    print(f"{'casting copy':40s} {cast / args.calls * 1e6:6.2f} µs")
    unit._free_full()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
