"""``module.to()``, ``.cuda()``, ``.half()`` and the like on a sharded model.

Note [conversions after shard()]: a shard parameter is a view of its unit's flat buffer (no_shard:
of its bucket). ``nn.Module._apply``, behind every conversion, assigns ``param.data = fn(param)``
whenever ``fn`` returns another tensor, and some return a copy even when nothing changes
(``.to("cpu:0")`` on a CPU tensor: transformers' Trainer moves its model to ``args.device``, which
is ``cpu:0`` under torchrun). The parameter would then no longer be a view of the buffer: the
optimizer would step the copy while every gather still reads the buffer, so training would go on
from stale weights, silently. So shard() guards the conversions of the model's modules: one that
keeps a shard's device, dtype and shape keeps the shard itself; one that would change them raises,
since the flat buffers were laid out on the device and in the dtype shard() chose.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from .errors import ShardwiseError
from .runtime import Runtime
from .unit import ShardedUnit


def guard_conversions(model: nn.Module, rt: Runtime) -> None:
    """Make every conversion of ``model``'s modules keep its runtime's shard parameters (no_shard:
    its whole parameters, views of the bucket) as they are, or raise."""
    ids = {id(p) for u in rt.units for p in (u.shard_params if isinstance(u, ShardedUnit) else u.params)}
    for module in model.modules():
        original = module._apply  # bound: its own recursion calls the children's, guarded too

        def _apply(fn: Callable, recurse: bool = True, _original=original):
            return _original(fn if getattr(fn, "_shardwise_keeps", False) else _keeping(fn, ids), recurse)

        module._apply = _apply


def _keeping(fn: Callable, ids: set[int]) -> Callable:
    def keep(t: torch.Tensor):
        out = fn(t)
        if id(t) not in ids or out is t:
            return out
        if out.device == t.device and out.dtype == t.dtype and out.shape == t.shape:
            return t  # a copy that changes nothing: keep the view of the flat buffer
        raise ShardwiseError(
            f"a conversion of the sharded model would change its parameters from {t.dtype} on "
            f"{t.device} to {out.dtype} on {out.device} (model.to(), .cuda(), .half(), ...): shard() "
            "laid each rank's rows out in its own buffers and would lose them. Convert the model "
            "before shard() (which puts each rank's rows on its device itself), or choose the "
            "compute dtype with shard(mixed_precision=...)"
        )

    keep._shardwise_keeps = True
    return keep
