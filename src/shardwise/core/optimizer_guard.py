"""What shardwise checks as an optimizer steps (one global step pre-hook, installed by the
first ``shard()``): it refuses to step a parameter ``shard()`` replaced, or matrices split in
rows under an optimizer that needs whole ones (``placement.check_whole_matrices``), and it
settles a model left between a forward and its backward (Note [a step after a forward]).

The marks it reads are written here too: ``retire`` on the parameters ``shard()`` replaced,
``watch`` on the shard parameters of a runtime.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import placement
from .errors import ShardwiseError
from .runtime import Phase, Runtime
from .unit import ShardedUnit

_checked_optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_installed = False


def retire(p: nn.Parameter, fqn: str) -> None:
    """Mark (and empty) an original parameter ``shard()`` replaced with shards: an optimizer
    built from it beforehand is refused by name."""
    if not hasattr(p, "_shardwise_retired"):
        p._shardwise_retired = fqn
        if not p.is_meta:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def watch(rt: Runtime) -> None:
    """Install the step pre-hook (once), and let it find ``rt`` from its shard parameters."""
    global _installed
    for u in rt.units:
        for p in u.shard_params if isinstance(u, ShardedUnit) else u.params:
            p._shardwise_runtime = weakref.ref(rt)  # Note [a step after a forward]
    if not _installed:
        register_optimizer_step_pre_hook(_check_optimizer)
        _installed = True


# Note [a step after a forward]: a forward with gradients on leaves units gathered for the
# backward it expects (the root always; every unit under shard_grad_op). A loop that skips
# that backward (a loss that is NaN, a micro-batch it drops) and still steps the optimizer
# changes the shards under them, and the next forward, finding them gathered, would compute on
# the parameters from before the step, silently. So the optimizer's step first settles the
# runtimes of the parameters it steps when they are between a forward and a backward: their
# units reshard and gather again, from the new shards, when next called.
def _check_optimizer(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    key = tuple(len(g["params"]) for g in optimizer.param_groups)
    checked = _checked_optimizers.get(optimizer)
    if checked is None or checked[0] != key:
        checked = _checked_optimizers[optimizer] = (key, _check_params(optimizer))
    for ref in checked[1]:
        rt = ref()
        if rt is not None and rt.phase is Phase.FORWARD:
            rt.settle()


def _check_params(optimizer: torch.optim.Optimizer) -> list[weakref.ref]:
    """Refuse what the optimizer must not step; return the runtimes of its parameters."""
    runtimes = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            name = getattr(p, "_shardwise_retired", None)
            if name is not None:
                raise ShardwiseError(
                    f"{type(optimizer).__name__} steps parameter '{name}' as it was before "
                    "shardwise.shard(), which replaced it with this rank's shard: the optimizer "
                    "would update nothing. Build the optimizer after shard(), from "
                    "model.parameters()."
                )
            ref = getattr(p, "_shardwise_runtime", None)
            if ref is not None:
                runtimes[id(ref())] = ref
    placement.check_whole_matrices(optimizer)
    return list(runtimes.values())
