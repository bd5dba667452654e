"""Replica groups on torchft: the quorum each step, the average across groups, the commit,
and healing a group that joins from a live one, rank for rank.

Each torchrun job is one replica group. Its first replica's ranks (all of them, unless it
shards hybrid; rank 0 alone with no_shard) each run a torchft ``Manager`` (rank 0's talks to the lighthouse for the group).
Inside the job shardwise shards as usual; across groups, shard index r of every group averages
its reduced gradient shards with shard index r of the others through the manager's process
group (``Manager.allreduce``: errors are reported to the manager, not raised, and a step that
met one does not commit).

Note [jobs of different sizes]: torchft joins rank r of every replica group in one process
group, so its groups must have as many ranks as each other, and shardwise's must hold the same
rows rank for rank. A job with hybrid sharding therefore shows torchft one replica, its first
(with no_shard, rank 0: every rank is a replica): those ranks run the managers, and the job's other replicas follow them (each learns the
quorum, the heal, the average and the commit from the rank of its shard index in the first
replica, over the job's own replicate group). A job of two nodes and a job of one, both
sharding within a node, train together and heal each other rank for rank with nothing to
reshard. Each job's average counts by its ranks (``weight``: like one process on the batches
of every rank taking part). Jobs whose shard groups differ (full_shard over 4 ranks against 2)
cannot average a gradient row for row at all, so a reshard at the heal would not let them
train together: ``CannotHeal`` names the difference and the fix (hybrid sharding within a node).

Note [quorum at the start of the step]: the quorum is synchronous (``use_async_quorum=False``):
``zero_grad`` waits for it, and a group that is behind takes a live group's state right there,
before its forward, so it takes part in that very step and ``ft.step`` is exact as soon as
``zero_grad`` returns (the loop picks its batch and learning rate from it). With torchft's
asynchronous quorum the state would arrive in the middle of the step, and what the loop set
meanwhile (the learning rate of this step) would race with what is served. The cost is one
round trip to the lighthouse a step (docs/fault_tolerance.md measures it). While it waits,
every rank probes the lighthouse, so a lost lighthouse ends every rank with ``LighthouseLost``
in about two seconds instead of at the quorum's timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn as nn
from torchft.manager import Manager

from ..core.errors import ShardwiseError
from ..core.runtime import runtime_of
from . import heal
from .diloco import DiLoCo, Done, fragments_of, nesterov, outer_optimizer_of
from .errors import FaultToleranceError
from .feedback import codec_of
from .lighthouse import url as lighthouse_url
from .place import Place
from .quorum import Phase, Quorum
from .steps import Heal, Steps
from .transport import Transport


class Torchft(Steps):
    """Fault tolerance across replica groups (one torchrun job each) on torchft.

        ft = shardwise.ft.Torchft(lighthouse=os.environ["TORCHFT_LIGHTHOUSE"], replica_id="node3")
        shardwise.shard(model, wrap=..., fault_tolerance=ft)
        opt = ft.optimizer(torch.optim.AdamW(model.parameters()))
        while ft.step < steps:
            opt.zero_grad()                       # joins the quorum; heals a group that is behind
            x, y = batch(ft.step)                 # committed steps so far: the same on every group
            model(x, y).backward()                # gradients averaged over the groups taking part
            opt.step()                            # steps only if the step commits

    lighthouse: torchft's lighthouse, ``http://HOST:PORT`` (``shardwise lighthouse``).
    replica_id: this group's name, the same on all its ranks and across its restarts.
    min_replicas: groups a step needs to commit.
    timeout: seconds for a collective across groups, a commit and a state transfer.
    quorum_timeout: seconds a quorum may take: a dead group is dropped after the lighthouse's
    heartbeat timeout, a group that heartbeats but is late after its join timeout (``shardwise
    lighthouse``: 2 s and 1 s). A lost lighthouse is named within seconds, but the process
    exits only once torchft's quorum thread gives up, after this long.
    hostname: the address other groups reach this node at (default: this node's address on
    the route to the lighthouse).
    Jobs of different sizes train together where they shard within the same number of
    ranks (hybrid sharding within a node; Note [jobs of different sizes]).
    max_failed_steps: steps in a row that may fail to commit before ``FaultToleranceError``.
    """

    def __init__(
        self,
        lighthouse: str,
        replica_id: str,
        *,
        min_replicas: int = 1,
        timeout: float = 30.0,
        quorum_timeout: float = 30.0,
        hostname: str | None = None,
        max_failed_steps: int = 10,
    ):
        try:
            self.lighthouse = lighthouse_url(lighthouse)
        except ValueError as e:
            raise FaultToleranceError(f"Torchft(lighthouse={lighthouse!r}): {e}") from None
        if not replica_id or ":" in replica_id or "/" in replica_id:
            raise FaultToleranceError(
                f"Torchft(replica_id={replica_id!r}): name the group (e.g. 'node3'), without ':' or '/'"
            )
        self.replica_id = replica_id
        self.min_replicas, self.timeout, self.quorum_timeout = min_replicas, timeout, quorum_timeout
        self.hostname, self.max_failed_steps = hostname, max_failed_steps
        self.last_heal: Heal | None = None
        self._manager: Manager | None = None
        self._transport: Transport | None = None
        self._model: nn.Module | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._phase = Phase.READY
        self._failed = 0  # steps in a row that did not commit
        self._snapshot: heal.Snapshot | None = None  # what this rank serves a healing rank this step
        self._kept: heal.Transient | None = None  # what a step that does not commit must undo
        self._place: Place | None = None
        self._quorum = Quorum(0, {"step": 0, "batches_committed": 0})  # the manager's (or the first replica's) last word
        self._healed: heal.Snapshot | None = None  # the state this rank healed to, for the job's other replicas
        self._holding: heal.Holding | None = None  # once the optimizers are known
        self._fingerprint: torch.Tensor | None = None
        self._diloco: DiLoCo | None = None  # set by diloco(): rounds of inner steps (ft/diloco.py)

    # --- what users read
    @property
    def step(self) -> int:
        """Committed steps so far (the same on every live group once ``zero_grad`` returned).
        Under ``diloco``, inner steps: those of the committed rounds and of this round."""
        if self._diloco is None:
            return self.rounds
        return max(0, self.rounds - 1) * self._diloco.every + self._diloco.local  # Note [a round is one torchft step]

    def optimizer(self, *optimizers: torch.optim.Optimizer) -> FaultTolerantOptimizer:
        """Wrap the model's optimizers (e.g. Muon and AdamW): ``zero_grad`` joins the quorum,
        ``step`` commits or skips. Call once, after ``shard(..., fault_tolerance=self)``."""
        self._check_first_call("optimizer", "ft.optimizer() was called already: pass every optimizer in one call")
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise ShardwiseError("ft.optimizer() takes the torch.optim optimizers of the sharded model")
        self._optimizers = list(optimizers)
        return FaultTolerantOptimizer(self, self._optimizers)

    def diloco(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        sync_every: int,
        outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
        fragments: int = 1,
        fragment_sync_delay: int = 0,
        comm: str | None = None,
    ) -> DiLoCo:
        """Train with DiLoCo across the groups (ft/diloco.py): ``optimizer`` (the inner one,
        over the sharded model's parameters) steps ``sync_every`` times with no traffic across
        groups, then the groups average their pseudo-gradients and ``outer_optimizer(params)``
        (default Nesterov SGD, lr 0.7, momentum 0.9; 0.8 with top-k messages) steps the
        global parameters. ``ft.step`` counts inner steps. Call once, after ``shard(...,
        fault_tolerance=self)``, instead of ``optimizer()``. ``comm``: the pseudo-gradients
        in fp32 (None), shardwise's int8 or SparseLoCo's top-k with 2-bit values ("topk"),
        both with error feedback.
        ``fragments`` > 1: streaming DiLoCo, one of that many parts of the parameters synced
        every ``sync_every / fragments`` steps in turn, each ``fragment_sync_delay`` inner
        steps after its all-reduce was issued (ft/diloco.py's Note [streaming DiLoCo])."""
        self._check_first_call("diloco", "ft.diloco() or ft.optimizer() was called already: call one of them, once")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ShardwiseError("ft.diloco() takes the inner torch.optim optimizer of the sharded model")
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ShardwiseError(f"ft.diloco(sync_every={sync_every!r}): the inner steps of a round, an int >= 1")
        codec_of(comm)  # (checked before anything is built)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        fragments_of(len(params), sync_every, fragments, fragment_sync_delay)
        outer = outer_optimizer_of(outer_optimizer or nesterov(comm), params)
        self._optimizers = [optimizer, outer]
        self._diloco = DiLoCo(self, optimizer, sync_every, outer, comm, fragments, fragment_sync_delay)
        return self._diloco

    def _check_first_call(self, method: str, again: str) -> None:
        if self._model is None:
            raise ShardwiseError(f"ft.{method}() comes after shardwise.shard(model, ..., fault_tolerance=ft)")
        if self._optimizers:
            raise ShardwiseError(again)

    def shutdown(self) -> None:
        """Leave the quorum, stop this rank's servers and end its process group across groups
        (call at the end of training): that group's Gloo threads are joined now, not during
        interpreter shutdown, where one can abort the process (Note [exit] in core/groups.py)."""
        if self._manager is not None:
            self._manager.shutdown(wait=False)
            self._manager._pg.shutdown()  # (torchft's wrapper drops its backend group)
            self._manager = None

    # --- replica_groups.ReplicaGroups: what shard() and the units call
    def attach(self, model: nn.Module) -> None:
        if self._model is not None:
            raise ShardwiseError("a Torchft serves one model: make one per sharded model")
        self._model = model
        self._runtime = runtime_of(model)
        self._start_manager()

    def all_reduce(self, tensor: torch.Tensor):
        if self._diloco is not None:  # inner steps: nothing crosses groups
            return Done()
        if self._phase is not Phase.OPEN:
            raise ShardwiseError(
                "a backward reduced gradients outside a fault-tolerant step: call opt.zero_grad() "
                "(opt = ft.optimizer(...)) at the start of every step; it joins the quorum"
            )
        work = None
        if self._manager is not None:
            if self._quorum.weight != 1.0:  # (Note [jobs of different sizes])
                tensor.mul_(self._quorum.weight)
            work = self._manager.allreduce(tensor)
        return self._place.share(work, tensor)

    def size(self) -> int:
        return 1 if self._diloco is not None else self.participants


class FaultTolerantOptimizer:
    """The model's optimizers under a ``Torchft``: ``zero_grad()`` joins the step's quorum
    (taking a live group's state if this group is behind), ``step()`` steps them only if the
    step commits and returns whether it did. Iterating it gives the optimizers, so
    ``shardwise.save(path, model, opt)`` and ``shardwise.load`` take it as they take a list."""

    def __init__(self, ft: Torchft, optimizers: list[torch.optim.Optimizer]):
        self.ft, self.optimizers = ft, optimizers

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.ft.begin_step()
        for o in self.optimizers:
            o.zero_grad(set_to_none)

    def step(self, closure=None) -> bool:
        if closure is not None:
            raise ShardwiseError("a fault-tolerant step takes no closure")
        committed = self.ft.commit()
        if committed:
            for o in self.optimizers:
                o.step()
        return committed

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)
