"""Bad input gets a clear exception that names the problem and the fix."""

import pytest
import torch
import torch.nn as nn
from nets import Layer, PrimeMLP, batch, loss_of, make, wrap_policy

import shardwise
from shardwise import ShardwiseError


def shard_twice():
    model = shardwise.shard(make("mlp"))
    try:
        shardwise.shard(model)
    except ShardwiseError as e:
        return str(e)


def test_shard_twice(pools):
    msg = pools(1).run(shard_twice)[0]
    assert "already sharded" in msg and "PrimeMLP" in msg


class _OnOtherDevice(nn.Parameter):
    """A parameter that reports another device (a CPU-only machine has no second device)."""

    @property
    def device(self):
        return torch.device("cuda", 1)


def different_devices():
    model = make("mlp")
    model.out.weight = _OnOtherDevice(model.out.weight.detach())
    try:
        shardwise.shard(model)
    except ShardwiseError as e:
        return str(e)


def test_parameters_on_different_devices(pools):
    msg = pools(1).run(different_devices)[0]
    assert "different devices" in msg and "'out.weight' on cuda:1" in msg and "module.to" in msg


def bad_policy(which):
    model = make("mlp")
    if which == "container":
        policy = lambda m, name: name == "layers"  # noqa: E731
    elif which == "not_bool":
        policy = lambda m, name: 1 if name == "out" else 0  # noqa: E731
    else:
        model.out.double()
        policy = None
    try:
        shardwise.shard(model, wrap=policy)
    except ShardwiseError as e:
        return str(e)


def test_wrap_policy_selecting_a_container(pools):
    msg = pools(1).run(bad_policy, "container")[0]
    assert "'layers'" in msg and "ModuleList" in msg and "by_class" in msg


def test_wrap_policy_returning_non_bool(pools):
    msg = pools(1).run(bad_policy, "not_bool")[0]
    assert "returned 0 for 'layers'" in msg and "True or False" in msg


def test_unit_with_mixed_dtypes(pools):
    msg = pools(1).run(bad_policy, "dtypes")[0]
    assert "mixes parameter dtypes" in msg and "out.weight" in msg


def optimizer_first():
    model = make("mlp")
    opt = torch.optim.AdamW(model.parameters())
    shardwise.shard(model, wrap=wrap_policy("by_class", "mlp"))
    x, y = batch("mlp", 0, 2)
    loss_of(model, x, y).backward()
    try:
        opt.step()
    except ShardwiseError as e:
        return str(e)


def test_optimizer_built_before_shard(pools):
    msg = pools(1).run(optimizer_first)[0]
    assert "before shardwise.shard()" in msg and "'gain'" in msg  # the first one it steps
    assert "Build the optimizer after shard()" in msg


def never_called_unit():
    class Odd(nn.Module):  # uses its child's weight directly, never calls the child
        def __init__(self):
            super().__init__()
            self.inner = Layer(4, 4)

        def forward(self, x):
            return x @ self.inner.lin.weight

    model = shardwise.shard(Odd(), wrap=shardwise.wrap.by_class(Layer))
    try:
        model(torch.randn(2, 4)).sum().backward()
    except Exception as e:
        return type(e).__name__, str(e)
    return None, ""


@pytest.mark.parametrize("world_size", [1, 2])
def test_parameters_used_outside_their_units_forward(pools, world_size):
    for kind, msg in pools(world_size).run(never_called_unit):
        assert kind == "ShardwiseError"
        assert "'inner.lin.weight'" in msg and "'inner'" in msg and "register_forward_method" in msg


def strategy_typo():
    try:
        shardwise.shard(PrimeMLP(), strategy="fullshard")
    except ShardwiseError as e:
        return str(e)


def test_unknown_strategy(pools):
    assert "'fullshard'" in pools(1).run(strategy_typo)[0]


def agree_on(problems: list[str]):
    """Each rank's own problem; what ``agree`` makes of rank 0's, on every rank."""
    import torch.distributed as dist

    from shardwise.core import collectives

    rank = dist.get_rank()
    try:
        return collectives.agree(problems[rank], "test agree", ShardwiseError, value=f"from rank {rank}")
    except ShardwiseError as e:
        return f"raised: {e}"


def test_agree_decides_on_rank_0_and_raises_on_every_rank(pools):
    pool = pools(2)
    assert pool.run(agree_on, ["", "rank 1 alone is not read"]) == ["from rank 0", "from rank 0"]
    assert pool.run(agree_on, ["bad input", ""]) == [
        "raised: bad input", "raised: bad input (reported by rank 0)",
    ]
