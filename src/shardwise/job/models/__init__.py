"""Built-in models: the GPT the training job uses, an MLP stack for benchmarks, and a GPT of
stock torch modules (``MHAGPT``) that benchmarks and tests use as a model shardwise never shaped."""

from .gpt import GPT, GPT_SIZES, Block, GPTConfig, gpt_config, num_params
from .mha import MHAGPT, MHABlock
from .mlp import Layer, MLPStack

__all__ = [
    "GPT", "GPTConfig", "Block", "GPT_SIZES", "gpt_config", "num_params", "MLPStack", "Layer",
    "MHAGPT", "MHABlock",
]
