"""Save and load time and peak host memory: shardwise's own format against DCP, and FSDP2's DCP.

    python benchmarks/checkpoint_formats.py --nproc 2 --rounds 3
    python benchmarks/checkpoint_formats.py --nproc 4 --rounds 3

Local ranks (Gloo), the built-in GPT medium (31.7M parameters) wrapped per block, AdamW after
one step (so a checkpoint is 3 x 127 MB of fp32). Each round, in turn: shardwise ``save`` and
``load`` in its own format, the same with ``format="dcp"``, and FSDP2 (``fully_shard`` per
block) saving and loading the same state with ``get_state_dict`` + ``dcp.save`` and ``dcp.load``
+ ``set_state_dict``. Times are the slowest rank's (a save or load ends when every rank's does),
the median over rounds; memory is the largest per-rank growth of peak RSS (``VmHWM``, reset
through ``/proc/self/clear_refs``) during the call. The page cache is warm (files just
written). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def measured(fn, path: str) -> tuple[float, float]:
    """Seconds and peak RSS growth (MiB) of ``fn(path)`` on this rank, after a barrier."""
    import torch.distributed as dist

    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # peak RSS := current RSS
    before = _rss_kib("VmRSS")
    t0 = time.perf_counter()
    fn(path)
    seconds = time.perf_counter() - t0
    return seconds, (_rss_kib("VmHWM") - before) / 1024


def rank_main(rounds: int, root: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    import shardwise
    from shardwise.core import groups
    from shardwise.job.data import get_batch, rank_slice
    from shardwise.job.models import GPT, Block, gpt_config

    groups.init()
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = get_batch(0, 2 * world, 64)
    x, y = rank_slice(x, rank, world), rank_slice(y, rank, world)

    def stepped(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        return opt

    torch.manual_seed(0)
    ours = shardwise.shard(
        GPT(gpt_config("medium", seq_len=64)), wrap=shardwise.wrap.by_class(Block)
    )
    our_opt = stepped(ours)
    torch.manual_seed(0)
    theirs = GPT(gpt_config("medium", seq_len=64))
    for block in theirs.modules():
        if isinstance(block, Block):
            fully_shard(block)
    fully_shard(theirs)
    their_opt = stepped(theirs)

    def fsdp2_save(path):
        msd, osd = get_state_dict(theirs, their_opt)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=path)

    def fsdp2_load(path):
        msd, osd = get_state_dict(theirs, their_opt)
        sd = {"model": msd, "optimizer": osd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(
            theirs, their_opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"]
        )

    cases = {
        "shardwise, own format": (
            lambda p: shardwise.save(p, ours, our_opt),
            lambda p: shardwise.load(p, ours, our_opt),
        ),
        "shardwise, DCP": (
            lambda p: shardwise.save(p, ours, our_opt, format="dcp"),
            lambda p: shardwise.load(p, ours, our_opt),
        ),
        "FSDP2, DCP": (fsdp2_save, fsdp2_load),
    }
    out: dict = {}
    for r in range(rounds):
        for name, (save, load) in cases.items():
            path = os.path.join(root, f"{r}-{name.replace(', ', '-').replace(' ', '_')}")
            out.setdefault(name, []).append((*measured(save, path), *measured(load, path)))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    from shardwise.core.groups import launch_local

    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as root:
        ranks = launch_local(a.nproc, rank_main, a.rounds, root)
    names = list(next(iter(ranks.values())))
    print(
        f"N={a.nproc}, {a.rounds} rounds: slowest rank's median seconds; largest per-rank peak RSS growth"
    )
    print("| system | save s | save peak MiB | load s | load peak MiB |")
    print("| --- | --- | --- | --- | --- |")
    for name in names:
        per_round = list(zip(*(ranks[r][name] for r in ranks)))  # rounds x ranks
        cols = []
        for i, kind in enumerate(("s", "MiB", "s", "MiB")):
            if kind == "s":
                cols.append(
                    f"{statistics.median(max(rk[i] for rk in rnd) for rnd in per_round):.2f}"
                )
            else:
                cols.append(f"{max(rk[i] for rnd in per_round for rk in rnd):.0f}")
        print(f"| {name} | " + " | ".join(cols) + " |")


if __name__ == "__main__":
    main()
