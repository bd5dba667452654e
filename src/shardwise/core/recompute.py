"""Activation checkpointing: chosen submodules keep only their inputs and recompute the rest
in backward (torch.utils.checkpoint, non-reentrant); selectively, they also keep the outputs
of their matrix products and attention, and recompute only the cheap operations between."""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from .errors import ShardwiseError
from .wrap import Policy

# what selective checkpointing keeps: the results that cost FLOPs to recompute (torchtitan's
# op-level selective checkpointing keeps the same kind)
_KEPT_OPS = {
    getattr(torch.ops.aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(torch.ops.aten, name)
}


def _keep_products(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective():
    return create_selective_checkpoint_contexts(_keep_products)


def recomputes(module: nn.Module) -> bool:
    """Whether ``checkpoint_activations`` wrapped ``module``'s forward."""
    return getattr(module, "_shardwise_checkpointed", False)


def checkpoint_activations(model: nn.Module, policy: Policy, *, selective: bool = False) -> list[str]:
    """Recompute the activations of every submodule ``policy`` selects; returns their names.
    ``selective``: keep the outputs of matrix products and attention, recompute the rest
    (less memory saved, little compute spent).

    The module's own ``forward`` is wrapped, so its hooks (a unit's gather and reshard) still
    run outside the recomputed region: inside a full_shard unit, backward gathers the unit
    before recomputation needs it, and each parameter still gets its gradient once. Works
    before or after ``shard()``.
    """
    context = {"context_fn": _selective} if selective else {}
    chosen = []
    for name, module in model.named_modules():
        if not name or not policy(module, name):
            continue
        if recomputes(module):
            raise ShardwiseError(f"'{name}' already recomputes its activations")
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            if torch.is_grad_enabled():
                kwargs = _without_cache(kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **context, **kwargs)

        module.forward = forward
        module._shardwise_checkpointed = True
        chosen.append(name)
    if not chosen:
        raise ShardwiseError(f"activation checkpointing policy {policy!r} selected no module")
    return chosen


# Note [no KV cache where activations are recomputed]: a Hugging Face layer appends its keys
# and values to the cache object it is given, in place. Recomputation runs the layer again, so
# the cache would get them twice (the model returns a cache twice as long, silently), and
# selective recomputation finds the tensors it kept no longer match (torch raises deep inside
# backward). Training needs no cache: as Hugging Face's own gradient checkpointing does, a
# recomputed layer runs without one while gradients are recorded, with a warning.
_CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past")  # (names across transformers releases)


def _without_cache(kwargs: dict) -> dict:
    """``kwargs`` without a KV cache (Note [no KV cache where activations are recomputed])."""
    if not any(kwargs.get(k) is not None for k in _CACHE_ARGS) and not kwargs.get("use_cache"):
        return kwargs
    warnings.warn(
        "a layer whose activations are recomputed runs without its KV cache while training (as with "
        "Hugging Face's gradient checkpointing); set model.config.use_cache = False to silence this",
        stacklevel=3,
    )
    kwargs = {k: (None if k in _CACHE_ARGS else v) for k, v in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return kwargs
