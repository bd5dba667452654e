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
(docs/fault_tolerance.md). Modules: replicas (the quorum, the average across groups, the
commit), heal (what a rank serves and takes), lighthouse (the quorum server, ``shardwise
lighthouse``), errors.
"""

import os

# torchft's servers log every quorum at INFO; RUST_LOG=info shows them again
os.environ.setdefault("RUST_LOG", "warn")

try:
    import torchft  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"shardwise.ft needs torchft: pip install 'shardwise[ft]' ({e})") from e

from .errors import CannotHeal, FaultToleranceError, LighthouseLost, LighthouseUnreachable
from .replicas import FaultTolerantOptimizer, Heal, Torchft

__all__ = [
    "Torchft",
    "FaultTolerantOptimizer",
    "Heal",
    "FaultToleranceError",
    "LighthouseUnreachable",
    "LighthouseLost",
    "CannotHeal",
]
