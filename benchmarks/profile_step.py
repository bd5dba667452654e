"""Profile a few steps of one benchmark system on every rank with torch.profiler.

    torchrun --nproc_per_node 2 benchmarks/profile_step.py --system shardwise/full_shard --out prof

Builds the system exactly as ``shardwise bench`` does (same model, seed and batches), takes the
warm-up steps, runs ``--steps`` steps unprofiled and prints rank 0's wall time, process CPU time
and minor page faults per step (``getrusage``), then profiles ``--steps`` steps. Rank 0 prints
the operators by self CPU time (``--shapes``: by input shapes too); every rank writes a Chrome
trace (open in https://ui.perfetto.dev) to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from shardwise.bench import harness as bench
from shardwise.core import groups


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", choices=bench.SYSTEMS, default="shardwise/full_shard")
    p.add_argument("--model", choices=bench.MODELS, default="small")
    p.add_argument("--batch-size", type=int, default=bench.BenchConfig.batch_size)
    p.add_argument("--seq-len", type=int, default=bench.BenchConfig.seq_len)
    p.add_argument("--steps", type=int, default=3, help="profiled steps")
    p.add_argument("--stack", action="store_true", help="record Python stacks (slower)")
    p.add_argument("--shapes", action="store_true", help="record and group by input shapes")
    p.add_argument("--out", default="prof")
    a = p.parse_args()
    cfg = bench.BenchConfig(
        model=a.model,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        steps=a.steps,
        systems=(a.system,),
    )
    groups.init()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = groups.device()
    work = bench.workload(cfg, rank, world, device)
    meshes = bench.device_meshes(cfg, device)
    model, opt, autocast = bench.build_system(a.system, cfg, work, device, meshes)
    for x, y in work.batches[: cfg.warmup]:
        bench.train_step(model, opt, autocast, work, x, y)
    before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for x, y in work.batches[cfg.warmup :]:
        bench.train_step(model, opt, autocast, work, x, y)
    after, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    if rank == 0:
        n = len(work.batches) - cfg.warmup
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        print(
            f"unprofiled, per step (rank 0): wall {1e3 * (t1 - t0) / n:.1f} ms, process CPU "
            f"{1e3 * cpu / n:.1f} ms, minor page faults {(after.ru_minflt - before.ru_minflt) / n:.0f}"
        )
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, with_stack=a.stack, record_shapes=a.shapes) as prof:
        for i, (x, y) in enumerate(work.batches[cfg.warmup :]):
            dist.barrier()
            with record_function(f"step{i}"):
                bench.train_step(model, opt, autocast, work, x, y)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / f"{a.system.replace('/', '-')}-rank{rank}.json"))
    if rank == 0:
        table = prof.key_averages(group_by_input_shape=a.shapes)
        print(table.table(sort_by="self_cpu_time_total", row_limit=30))
    dist.barrier()


if __name__ == "__main__":
    main()
