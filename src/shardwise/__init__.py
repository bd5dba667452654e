"""shardwise: Fully Sharded Data Parallel training for PyTorch, on torch.distributed's collectives.

    import shardwise
    shardwise.init()                                   # torchrun's environment, nccl or gloo
    model = GPT(cfg)
    shardwise.shard(model, wrap=shardwise.wrap.auto(model))  # one unit per Block
    opt = torch.optim.AdamW(model.parameters())        # sees only this rank's shards
"""

from . import placement, wrap
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
from .recompute import checkpoint_activations
from .collectives import CollectiveStats, comm_stats, reset_comm_stats
from .errors import CollectiveError, ShardwiseError
from .groups import init
from .options import ShardOptions
from .policies import Comm, MixedPrecision, Settings, UnitConfig
from .scaler import GradScaler
from .observer.accounting import dtype_table, held_bytes
from .planner.plan import plan
from .observer.trace import trace

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
