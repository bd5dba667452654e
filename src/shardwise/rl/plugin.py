"""vLLM's ``vllm.general_plugins`` entry point: registers the "shardwise" weight-transfer
backend (both sides) in every vLLM process, the engine's workers included. Loading it twice
in one process is harmless, as vLLM asks of its plugins."""

from __future__ import annotations

BACKEND = "shardwise"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "shardwise.rl.engine", "ShardwiseWeightTransferEngine"
        )
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            BACKEND, "shardwise.rl.sender", "ShardwiseTrainerWeightTransferEngine"
        )
