"""One rank of the two-node test (test_multinode.py): each of two torchrun agents starts two
of these; they train hybrid_shard with the node as shard group (torchrun's LOCAL_WORLD_SIZE,
the default shard_size) beside the unsharded reference, and rank 0 writes what it found."""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nets import train_pair

import shardwise
from shardwise.core import groups


def main(out: str) -> None:
    shardwise.init(timeout=60)
    result = train_pair("tied", "hybrid_shard", "by_class", steps=6)
    mesh = groups.mesh_of(None, None, hybrid=True, shard_size=None)  # the one shard() built
    mine = {
        "rank": dist.get_rank(),
        "node": os.environ["TEST_NODE"],
        "shard_group": dist.get_process_group_ranks(mesh.shard),
        "replicate_group": dist.get_process_group_ranks(mesh.replicate),
    }
    layout = [None] * dist.get_world_size()
    dist.all_gather_object(layout, mine)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"layout": layout, "result": result}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
