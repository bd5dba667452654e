"""shardwise: Fully Sharded Data Parallel training for PyTorch, on torch.distributed's collectives.

    import shardwise
    shardwise.init()                                   # torchrun's environment, nccl or gloo
    model = GPT(cfg)
    shardwise.shard(model, wrap=shardwise.wrap.auto(model))  # one unit per Block
    opt = torch.optim.AdamW(model.parameters())        # sees only this rank's shards
"""

from typing import TYPE_CHECKING

from . import moved
from .api import (
    clip_grad_norm_,
    full_state_dict,
    gathered,
    load_full_state_dict,
    no_sync,
    register_forward_method,
    reset,
    shard,
    unit_states,
    units,
)
from .checkpoint import (
    CheckpointError,
    CheckpointInfo,
    SaveHandle,
    convert,
    latest,
    load,
    load_full,
    save,
    save_pretrained,
)
from .core import placement, wrap
from .core.collectives import CollectiveStats, comm_stats, reset_comm_stats
from .core.errors import CollectiveError, ShardwiseError
from .core.groups import init
from .core.policies import Comm, MixedPrecision, Settings, UnitConfig
from .core.recompute import checkpoint_activations
from .core.scaler import GradScaler
from .options import ShardOptions

if TYPE_CHECKING:  # what type checkers and editors see of the names loaded lazily below
    from .observer.accounting import dtype_table, held_bytes
    from .observer.trace import trace
    from .planner.plan import plan

# the planner and the observer load when first used, not with the library
_LAZY = {
    "plan": "shardwise.planner.plan",
    "trace": "shardwise.observer.trace",
    "dtype_table": "shardwise.observer.accounting",
    "held_bytes": "shardwise.observer.accounting",
}

__all__ = [
    "init",
    "shard",
    "wrap",
    "placement",
    "no_sync",
    "reset",
    "clip_grad_norm_",
    "full_state_dict",
    "load_full_state_dict",
    "gathered",
    "register_forward_method",
    "unit_states",
    "units",
    "MixedPrecision",
    "Comm",
    "UnitConfig",
    "Settings",
    "ShardOptions",
    "GradScaler",
    "save",
    "load",
    "latest",
    "load_full",
    "convert",
    "save_pretrained",
    "SaveHandle",
    "CheckpointInfo",
    "CheckpointError",
    "checkpoint_activations",
    "dtype_table",
    "held_bytes",
    "plan",
    "trace",
    "comm_stats",
    "reset_comm_stats",
    "CollectiveStats",
    "ShardwiseError",
    "CollectiveError",
]
__version__ = "0.1.0"

moved.install()


def __getattr__(name: str):
    if name in ("ft", "rl"):  # torchft / vLLM (the [ft] / [vllm] extras): subpackages, imported when used
        from importlib import import_module

        return import_module(f".{name}", __name__)
    if name in _LAZY:
        from importlib import import_module

        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value  # once: later lookups find it here
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
