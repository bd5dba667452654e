"""Built-in models: the GPT the training job uses and an MLP stack for benchmarks."""

from .gpt import GPT, GPT_SIZES, Block, GPTConfig, gpt_config, num_params
from .mlp import Layer, MLPStack

__all__ = [
    "GPT", "GPTConfig", "Block", "GPT_SIZES", "gpt_config", "num_params", "MLPStack", "Layer",
]
