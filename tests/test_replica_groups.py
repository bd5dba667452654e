"""The seam for replica groups outside the job (shardwise.core.replica_groups, ``shard(fault_tolerance=...)``),
without torchft: a pool of 4 ranks stands for 2 jobs of 2 ranks whose rank r average with each
other through a plain group (plain_groups.PlainGroups). Every strategy trains like one process
on the groups' batches that take part in each step, the groups stay bitwise equal, and the
average across groups is booked as ``replica_groups_all_reduce``."""

import copy

import pytest
import torch
import torch.distributed as dist
from nets import loss_of, make
from plain_groups import (
    GROUP_SIZE,
    PlainGroups,
    build,
    forward_backward,
    group_batch,
    jobs_in_pool,
    rank_state,
)

import shardwise

# which of the 2 groups take part in each step: both, then one, the other, both
RECORD = [[0, 1], [0, 1], [0], [1], [0, 1], [0, 1]]


def train_with_groups(kind: str, strategy: str, record, lr: float = 1e-2, **options):
    """Sharded jobs with the participation ``record`` beside the unsharded reference, which
    trains on the batches of the groups taking part; on rank 0 the losses and differences."""
    job_group, peers, job = jobs_in_pool()
    rank = dist.get_rank(job_group)
    outer = PlainGroups(peers, job, groups=2)
    ref = make(kind)
    start = copy.deepcopy(ref.state_dict())
    model, opt = build(outer, group=job_group, kind=kind, strategy=strategy, lr=lr, **options)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    shardwise.reset_comm_stats()
    for step, taking_part in enumerate(record):
        outer.taking_part = set(taking_part)
        forward_backward(model, kind, step, job, rank, GROUP_SIZE)
        opt.step()
        opt.zero_grad()
        batches = [group_batch(kind, step, g, 2, GROUP_SIZE) for g in taking_part]
        loss_of(ref, torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    stats = shardwise.comm_stats()["replica_groups_all_reduce"]
    full = shardwise.full_state_dict(model, rank0_only=False)
    diff = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    moved = max((start[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    mine = rank_state(model, opt)
    theirs = [None] * dist.get_world_size()
    dist.all_gather_object(theirs, mine)
    twin = theirs[(dist.get_rank() + GROUP_SIZE) % dist.get_world_size()]  # same rank, other job
    equal = all(torch.equal(v, twin[k]) for k, v in mine.items())
    return diff, moved, equal, stats.calls, stats.bytes


@pytest.mark.parametrize(
    "strategy,options",
    [
        ("full_shard", {}),
        ("shard_grad_op", {}),
        ("no_shard", {}),
        ("full_shard", {"mixed_precision": "bf16"}),
        ("full_shard", {"placement": shardwise.placement.matrices}),
    ],
    ids=["full_shard", "shard_grad_op", "no_shard", "bf16", "owned"],
)
def test_groups_train_like_one_process_on_the_batches_taking_part(pools, strategy, options):
    results = pools(4).run(train_with_groups, "tied", strategy, RECORD, **options)
    for diff, moved, equal, calls, nbytes in results:
        # bf16 computes in 16 bits: near the fp32 reference, not within its rounding noise
        tolerance = 0.5 * moved if options.get("mixed_precision") else 1e-5
        assert moved > 0.05 and diff <= tolerance, (diff, moved)
        assert equal  # rank r of both groups holds the same bits
        assert calls == 4 * len(RECORD)  # 3 blocks and the root, one average each
        assert nbytes > 0


def one_step_with(outer):
    model = shardwise.shard(make("tied"), fault_tolerance=outer)
    loss_of(model, *[t[:2] for t in group_batch("tied", 0, 0, 2, 1)]).backward()


def test_fault_tolerance_takes_replica_groups(pools):
    with pytest.raises(Exception, match="is not replica groups"):
        pools(2).run(one_step_with, object())
