"""Activation checkpointing: chosen submodules keep only their inputs and recompute the rest
in backward (torch.utils.checkpoint, non-reentrant)."""

from __future__ import annotations

import functools

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .errors import ShardwiseError
from .wrap import Policy


def checkpoint_activations(model: nn.Module, policy: Policy) -> list[str]:
    """Recompute the activations of every submodule ``policy`` selects; returns their names.

    The module's own ``forward`` is wrapped, so its hooks (a unit's gather and reshard) still
    run outside the recomputed region: inside a full_shard unit, backward gathers the unit
    before recomputation needs it, and each parameter still gets its gradient once. Works
    before or after ``shard()``.
    """
    chosen = []
    for name, module in model.named_modules():
        if not name or not policy(module, name):
            continue
        if getattr(module, "_shardwise_checkpointed", False):
            raise ShardwiseError(f"'{name}' already recomputes its activations")
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        module.forward = forward
        module._shardwise_checkpointed = True
        chosen.append(name)
    if not chosen:
        raise ShardwiseError(f"activation checkpointing policy {policy!r} selected no module")
    return chosen
