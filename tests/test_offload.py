"""CPU offload: master shards, gradients and optimizer state in host memory; on a CPU-only
machine host and device are the same memory, but every copy and hand-off still runs."""

import pytest
import torch
import torch.distributed as dist
from nets import batch, local_slice, loss_of, make, wrap_policy

import shardwise
from shardwise import ShardwiseError
from shardwise.core.unit import ShardedUnit


def train(strategy, cpu_offload, steps=6):
    model = shardwise.shard(make("tied"), wrap=wrap_policy("by_class", "tied"), strategy=strategy, cpu_offload=cpu_offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    sharded = [u for u in shardwise.units(model) if isinstance(u, ShardedUnit)]
    losses = []
    for step in range(steps):
        x, y = batch("tied", step, 2 * dist.get_world_size())
        loss = loss_of(model, local_slice(x), local_slice(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    devices = {p.device.type for p in model.parameters()} | {
        t.device.type for st in opt.state.values() for t in st.values()
    }
    return losses, shardwise.full_state_dict(model), all(u.offloaded == cpu_offload for u in sharded), devices


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
def test_offload_parity_is_exact(pools, strategy):
    pool = pools(2)
    plain = pool.run(train, strategy, False)
    offloaded = pool.run(train, strategy, True)
    for (l0, _sd0, _, _), (l1, _sd1, flag, devices) in zip(plain, offloaded):
        assert l0 == l1  # bitwise: the offload path only moves and copies
        assert flag and devices == {"cpu"}
    assert offloaded[0][1].keys() == plain[0][1].keys()
    assert all(torch.equal(plain[0][1][k], v) for k, v in offloaded[0][1].items())


def offload_with_no_shard():
    try:
        shardwise.shard(make("tied"), strategy="no_shard", cpu_offload=True)
    except ShardwiseError as e:
        return str(e)


def test_offload_needs_a_sharded_strategy(pools):
    assert "needs a sharded strategy" in pools(1).run(offload_with_no_shard)[0]
