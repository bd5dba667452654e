"""One rank of the two-node test (test_two_nodes.py): each node's torchrun agent starts one;
they train hybrid_shard across the shaped link (the nodes are replicas), exactly and with int8
on the link, and rank 0 writes the losses, the seconds and the cross-node bytes measured and
expected from the layouts."""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nets import batch, global_mean, local_slice, loss_of, make, wrap_policy

import shardwise
from shardwise.core.codecs import Codec


def expected_replica_bytes(model, codec) -> int:
    """Cross-node bytes per step: each unit's gradient shard all-reduced over the two replicas
    (encoded: the whole message to the other replica)."""
    total = 0
    for u in shardwise.units(model):
        n = u.grad_layout.sizes[u.rank]
        assert u.replicate_size == 2
        total += 4 * n if codec is None else codec.nbytes(n)
    return total


def run(comm: str | None, steps: int = 4) -> dict:
    model = shardwise.shard(make("tied"), wrap=wrap_policy("by_class", "tied"), strategy="hybrid_shard", comm=comm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        if step == 1:
            shardwise.reset_comm_stats()
        x, y = batch("tied", step, 8)
        loss_of(model, local_slice(x), local_slice(y)).backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss_of(model, local_slice(x), local_slice(y))))
    stats = shardwise.comm_stats()
    return {
        "losses": losses,
        "seconds": time.perf_counter() - t0,
        "replica_bytes": stats["replicate_all_reduce"].bytes // (steps - 1),
        "expected": expected_replica_bytes(model, Codec(comm) if comm else None),
    }


def main(out: str) -> None:
    shardwise.init(timeout=60)
    result = {comm or "exact": run(comm) for comm in (None, "int8")}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
