"""module.to() and friends after shard() (Note [conversions after shard()] in conversions.py): a
conversion that changes nothing keeps each shard a view of its flat buffer, so training goes on
from the stepped values (before the guard, ``.to("cpu:0")`` replaced every shard with a copy:
the optimizer stepped the copies while gathers read the buffers, and the model never changed);
one that would change the shards' dtype raises and leaves the model as it was."""

import pytest
import torch
import torch.nn as nn

import shardwise


def convert_then_train(strategy: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    shardwise.shard(model, wrap=shardwise.wrap.by_class(nn.Linear), strategy=strategy)
    shards = list(model.parameters())
    model.to("cpu:0")  # what transformers' Trainer does under torchrun on a CPU machine
    model.cpu().float().share_memory()
    kept = all(a is b for a, b in zip(shards, model.parameters()))
    refused = []
    for convert in (lambda m: m.half(), lambda m: m[0].to(torch.float64)):
        try:
            convert(model)
        except shardwise.ShardwiseError as e:
            refused.append(str(e))
    kept_after = all(p.dtype == torch.float32 for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = shardwise.full_state_dict(model, rank0_only=False)
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    after = shardwise.full_state_dict(model, rank0_only=False)
    moved = min((after[k] - before[k]).abs().max().item() for k in before)
    return kept, kept_after, refused, moved


@pytest.mark.parametrize("strategy", ["full_shard", "no_shard"])
def test_conversions_keep_or_refuse(pools, strategy):
    kept, kept_after, refused, moved = pools(2).run(convert_then_train, strategy)[0]
    assert kept and kept_after
    assert len(refused) == 2 and all("torch.float32 on cpu to torch.float" in r for r in refused), refused
    assert moved > 0  # every parameter's full value follows the optimizer's step
