"""Fault tolerance across replica groups on torchft (``pip install 'shardwise[ft]'``).

    ft = shardwise.ft.Torchft(lighthouse=os.environ["TORCHFT_LIGHTHOUSE"], replica_id="node3")
    shardwise.shard(model, wrap=..., fault_tolerance=ft)     # any strategy inside the job
    opt = ft.optimizer(torch.optim.AdamW(model.parameters()))
    while ft.step < steps:
        opt.zero_grad()            # joins the quorum; a group that is behind heals here
        model(*batch(ft.step)).backward()
        opt.step()                 # commits, or skips when a group failed during the step

Each torchrun job is one replica group; a lost group is dropped while the others go on, and a
group that comes back takes a live group's state rank for rank, from memory
(docs/fault_tolerance.md). Modules: replicas (``Torchft``: the settings and what users
call), steps (one step on a rank: the quorum, the heal, the vote), quorum (the records a step
hands over and the torchft manager's calls), place (where a rank stands in torchft's view of
its job), heal (what a rank serves and takes), transport (how a heal travels), lighthouse (the
quorum server, ``shardwise lighthouse``), diloco, fragment_sync, across, feedback and topk
(DiLoCo: the optimizer, a (fragment) sync's two halves, the groups as a sync sees them, error
feedback, SparseLoCo's message), errors.
"""

import os

# torchft's servers log every quorum at INFO; RUST_LOG=info shows them again
os.environ.setdefault("RUST_LOG", "warn")

try:
    import torchft  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"shardwise.ft needs torchft: pip install 'shardwise[ft]' ({e})") from e

from .errors import CannotHeal, FaultToleranceError, LighthouseLost, LighthouseUnreachable
from .replicas import FaultTolerantOptimizer, Torchft
from .steps import Heal

__all__ = [
    "Torchft",
    "FaultTolerantOptimizer",
    "Heal",
    "FaultToleranceError",
    "LighthouseUnreachable",
    "LighthouseLost",
    "CannotHeal",
]
