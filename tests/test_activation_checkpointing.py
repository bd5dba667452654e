"""Activation checkpointing: exact parity, fewer activations held."""


import pytest
import torch
import torch.distributed as dist
from nets import Attention, Block, batch, local_slice, loss_of, make, wrap_policy

import shardwise


def train(strategy, checkpoint, steps=4):
    model = shardwise.shard(make("tied"), wrap=wrap_policy("by_class", "tied"), strategy=strategy)
    if checkpoint:
        shardwise.checkpoint_activations(model, shardwise.wrap.by_class(checkpoint))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = batch("tied", step, 2 * dist.get_world_size())
        loss = loss_of(model, local_slice(x), local_slice(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, shardwise.full_state_dict(model)


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op", "no_shard"])
def test_checkpointing_parity(pools, strategy):
    pool = pools(2)
    plain = pool.run(train, strategy, None)[0]
    for target in (Block, Attention):  # the unit itself, and a module inside a unit
        ckpt = pool.run(train, strategy, target)[0]
        for a, b in zip(plain[0], ckpt[0]):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-7)
        for k, v in plain[1].items():
            assert torch.allclose(v, ckpt[1][k], rtol=0, atol=1e-6), k


def activation_peak(checkpoint):
    from torch.distributed._tools.mem_tracker import MemTracker

    from shardwise.models import GPT, gpt_config
    from shardwise.models import Block as GPTBlock

    torch.manual_seed(0)
    model = shardwise.shard(GPT(gpt_config("tiny", seq_len=64)), wrap=shardwise.wrap.by_class(GPTBlock))
    if checkpoint:
        shardwise.checkpoint_activations(model, shardwise.wrap.by_class(GPTBlock))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 256, (16, 64))
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        model(x, x).backward()
        opt.step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return {str(k): v for k, v in peak.items()}


def test_checkpointing_lowers_peak_activation_memory(pools):
    plain = pools(1).run(activation_peak, False)[0]
    ckpt = pools(1).run(activation_peak, True)[0]
    act = "_MemRefType.ACT"
    assert ckpt[act] * 2 <= plain[act], (plain, ckpt)  # at least 2x fewer activation bytes
    assert ckpt["Total"] < plain["Total"]
