"""shardwise in Lightning: ``lightning.Trainer(strategy="shardwise")``.

    import shardwise.lightning                     # registers "shardwise" with Lightning
    trainer = lightning.Trainer(strategy="shardwise", accelerator="cpu", devices=2)
    trainer = lightning.Trainer(strategy=shardwise.lightning.ShardwiseStrategy(
        wrap={Block}, mixed_precision="bf16", activation_checkpointing={Block}))

Needs ``pip install "shardwise[lightning]"``; ``import shardwise`` alone never imports Lightning.
What maps to what, and what is refused: docs/frameworks.md.
"""

try:
    from lightning.pytorch.strategies import StrategyRegistry
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "shardwise.lightning needs Lightning: pip install 'shardwise[lightning]'"
    ) from e

from .precision import ShardwisePrecision
from .strategy import ShardwiseStrategy

if ShardwiseStrategy.strategy_name not in StrategyRegistry:
    ShardwiseStrategy.register_strategies(StrategyRegistry)

__all__ = ["ShardwiseStrategy", "ShardwisePrecision"]
