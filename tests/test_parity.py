"""Sharded training equals single-process training on the same global batch (fp32)."""

import pytest
from nets import train_pair

WORLD_SIZES = [1, 2, 3, 4]
STRATEGIES = ["full_shard", "shard_grad_op", "no_shard"]
WRAPS = ["by_class", "by_size"]


@pytest.mark.parametrize("kind", ["tied", "mlp"])
@pytest.mark.parametrize("wrap", WRAPS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_parity(pools, world_size, strategy, wrap, kind):
    losses, ref_losses, diff, moved = pools(world_size).run(train_pair, kind, strategy, wrap)[0]
    assert len(losses) == 10
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert a == pytest.approx(b, rel=1e-5), f"step {step}: sharded {a} vs reference {b}"
    assert moved > 0.05  # the parameters really trained
    assert diff <= 1e-5
