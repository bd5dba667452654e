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

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torchft.checkpointing import HTTPTransport
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

from .. import collectives as C
from .. import groups
from ..checkpoint.state import param_slots
from ..errors import ShardwiseError
from ..runtime import runtime_of
from . import heal
from .diloco import DiLoCo, Done, codec_of, fragments_of, nesterov, outer_optimizer_of
from .errors import CannotHeal, FaultToleranceError, LighthouseLost, LighthouseUnreachable
from .lighthouse import local_address, reachable
from .lighthouse import url as lighthouse_url

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Heal:
    """The last time this rank took a live rank's state."""

    step: int  # the committed step it resumed at
    bytes: int  # tensor bytes received (its shards, optimizer state, buffers, residuals)
    seconds: float  # from asking for the state to having it in place


class Torchft:
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
        self._transport: _Transport | None = None
        self._model: nn.Module | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._snapshot: dict | None = None  # what this rank serves a healing rank this step
        self._kept: dict | None = None  # what a step that does not commit must undo
        self._in_step = False
        self._committed: bool | None = None  # the last step's vote (None: the loop skipped it)
        self._failed = 0  # steps in a row that did not commit
        self._place: _Place | None = None  # where this rank stands in torchft's view of the job
        # what the manager (this rank's, or its first replica's) said last: its state (the step), groups, weight
        self._told: dict = {"participants": 0, "state": {"step": 0, "batches_committed": 0}, "weight": 1.0}
        self._healed: dict | None = None  # the state this rank healed to, for the job's other replicas
        self._layout: dict | None = None  # what this rank holds (heal.layout), once the optimizers are known
        self._fingerprint: torch.Tensor | None = None
        self._diloco: DiLoCo | None = None  # set by diloco(): rounds of inner steps (ft/diloco.py)

    # --- what users read
    @property
    def step(self) -> int:
        """Committed steps so far (the same on every live group once ``zero_grad`` returned).
        Under ``diloco``, inner steps: those of the committed rounds and of this round."""
        step = self._manager.current_step() if self._manager is not None else self._told["state"]["step"]
        if self._diloco is None:
            return step
        return max(0, step - 1) * self._diloco.every + self._diloco.local  # Note [a round is one torchft step]

    @property
    def participants(self) -> int:
        """Replica groups in the current quorum."""
        return self._manager.num_participants() if self._manager is not None else self._told["participants"]

    def state_dict(self) -> dict[str, int]:
        """The committed step (and torchft's count of batches): save it with a checkpoint."""
        return self._manager.state_dict() if self._manager is not None else dict(self._told["state"])

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume the step count of a checkpoint (``state_dict``) before the first step."""
        if self._manager is not None:
            self._manager.load_state_dict(state)
        self._told = {**self._told, "state": dict(state)}

    def optimizer(self, *optimizers: torch.optim.Optimizer) -> FaultTolerantOptimizer:
        """Wrap the model's optimizers (e.g. Muon and AdamW): ``zero_grad`` joins the quorum,
        ``step`` commits or skips. Call once, after ``shard(..., fault_tolerance=self)``."""
        if self._model is None:
            raise ShardwiseError("ft.optimizer() comes after shardwise.shard(model, ..., fault_tolerance=ft)")
        if self._optimizers:
            raise ShardwiseError("ft.optimizer() was called already: pass every optimizer in one call")
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise ShardwiseError("ft.optimizer() takes the torch.optim optimizers of the sharded model")
        self._optimizers = list(optimizers)
        return FaultTolerantOptimizer(self, self._optimizers)

    def diloco(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        sync_every: int,
        outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] = nesterov,
        fragments: int = 1,
        fragment_sync_delay: int = 0,
        comm: str | None = None,
    ) -> DiLoCo:
        """Train with DiLoCo across the groups (ft/diloco.py): ``optimizer`` (the inner one,
        over the sharded model's parameters) steps ``sync_every`` times with no traffic across
        groups, then the groups average their pseudo-gradients and ``outer_optimizer(params)``
        (default Nesterov SGD, lr 0.7, momentum 0.9) steps the global parameters. ``ft.step``
        counts inner steps. Call once, after ``shard(..., fault_tolerance=self)``, instead of
        ``optimizer()``. ``comm``: the pseudo-gradients in fp32 (None), shardwise's int8 or
        SparseLoCo's top-k with 2-bit values ("topk"), both with error feedback.
        ``fragments`` > 1: streaming DiLoCo, one of that many parts of the parameters synced
        every ``sync_every / fragments`` steps in turn, each ``fragment_sync_delay`` inner
        steps after its all-reduce was issued (ft/diloco.py's Note [streaming DiLoCo])."""
        if self._model is None:
            raise ShardwiseError("ft.diloco() comes after shardwise.shard(model, ..., fault_tolerance=ft)")
        if self._optimizers:
            raise ShardwiseError("ft.diloco() or ft.optimizer() was called already: call one of them, once")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ShardwiseError("ft.diloco() takes the inner torch.optim optimizer of the sharded model")
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ShardwiseError(f"ft.diloco(sync_every={sync_every!r}): the inner steps of a round, an int >= 1")
        codec_of(comm)  # (checked before anything is built)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        fragments_of(len(params), sync_every, fragments, fragment_sync_delay)
        outer = outer_optimizer_of(outer_optimizer, params)
        self._optimizers = [optimizer, outer]
        self._diloco = DiLoCo(self, optimizer, sync_every, outer, comm, fragments, fragment_sync_delay)
        return self._diloco

    def shutdown(self) -> None:
        """Leave the quorum and stop this rank's servers (call at the end of training)."""
        if self._manager is not None:
            self._manager.shutdown(wait=False)
            self._manager = None

    # --- outer.ReplicaGroups: what shard() and the units call
    def attach(self, model: nn.Module) -> None:
        if self._model is not None:
            raise ShardwiseError("a Torchft serves one model: make one per sharded model")
        self._model = model
        self._runtime = runtime_of(model)
        self._start_manager()

    def all_reduce(self, tensor: torch.Tensor):
        if not self._in_step:
            raise ShardwiseError(
                "a backward reduced gradients outside a fault-tolerant step: call opt.zero_grad() "
                "(opt = ft.optimizer(...)) at the start of every step; it joins the quorum"
            )
        if self._diloco is not None:  # inner steps: nothing crosses groups
            return Done()
        work = None
        if self._manager is not None:
            if self._told["weight"] != 1.0:  # (Note [jobs of different sizes])
                tensor.mul_(self._told["weight"])
            work = self._manager.allreduce(tensor)
        return self._place.share(work, tensor)

    def size(self) -> int:
        return 1 if self._diloco is not None else self.participants

    # --- the manager
    def _start_manager(self) -> None:
        """Start this rank's manager (collective over the job): rank 0 checks the lighthouse
        and starts the group's store and manager server first, then the other ranks of the
        job's first replica join them (Note [jobs of different sizes])."""
        rank = dist.get_rank()
        self._place = _Place.of(self._runtime.mesh, self._runtime.sharding.shard)
        problem, store = self._start_first() if rank == 0 else ("", None)
        store_host, store_port = C.agree(problem, "torchft start", LighthouseUnreachable, group=groups.host_group(None), value=store)
        if rank != 0 and self._place.leads:
            self._manager = self._make_manager(store_host, store_port)

    def _start_first(self) -> tuple[str, tuple[str, int] | None]:
        deadline = time.monotonic() + min(10.0, self.timeout)
        while not reachable(self.lighthouse):
            if time.monotonic() > deadline:
                return (
                    f"no lighthouse answers at {self.lighthouse}: start one there (shardwise "
                    "lighthouse, or torchft_lighthouse --min_replicas 1) or fix the address "
                    "(TORCHFT_LIGHTHOUSE)", None,
                )
            time.sleep(0.2)
        host = self._host()
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        try:
            self._manager = self._make_manager(host, self._store.port)
        except Exception as e:  # the lighthouse went away in between, or refused us
            return f"the manager could not join the lighthouse at {self.lighthouse}: {e}", None
        return "", (host, self._store.port)

    def _host(self) -> str:
        return self.hostname or local_address(self.lighthouse)

    def _make_manager(self, store_host: str, store_port: int) -> Manager:
        seconds = timedelta(seconds=self.timeout)
        cuda = groups.device().type == "cuda"
        self._transport = _Transport(self._host(), seconds)
        return Manager(
            pg=ProcessGroupNCCL(timeout=seconds) if cuda else ProcessGroupGloo(timeout=seconds),
            load_state_dict=self._take,
            state_dict=self._serve,
            min_replica_size=self.min_replicas,
            use_async_quorum=False,  # Note [quorum at the start of the step]
            timeout=seconds,
            quorum_timeout=timedelta(seconds=self.quorum_timeout),
            connect_timeout=timedelta(seconds=min(10.0, self.timeout)),
            rank=self._place.rank,
            world_size=self._place.size,
            store_addr=store_host,
            store_port=store_port,
            lighthouse_addr=self.lighthouse,
            replica_id=self.replica_id,
            hostname=self._host(),
            checkpoint_transport=self._transport,
        )

    # --- one step
    def begin_step(self) -> None:
        """Join this step's quorum (heal if behind) and check that the groups match."""
        if not self._optimizers:
            raise ShardwiseError("wrap the optimizer first: opt = ft.optimizer(torch.optim.AdamW(...))")
        scaler = self._runtime.grad_scaler
        if self._kept is not None and self._committed is False:  # the step before failed
            heal.restore_transient(self._runtime, scaler, self._kept)
        if self._layout is None:
            slots = param_slots(self._runtime)
            self._layout = heal.layout(self._runtime, self._optimizers, slots, self._place.rank, self._place.size)
        told = self._place.tell(self._lead_step(scaler) if self._manager is not None else None)
        if told["error"] is not None:
            raise told["error"]
        self._told = told
        if told["healed"]:
            self._share_heal(scaler)
        if scaler is not None and self.step == 0:
            _one_scale(scaler)
        # after a heal its state is the step's start; else the snapshot's copies of the buffers are
        unchanged = self._snapshot["buffers"] if self._manager is not None and not told["healed"] else None
        self._kept = heal.transient(self._runtime, scaler, unchanged)
        self._in_step, self._committed = True, None

    def _lead_step(self, scaler) -> dict:
        """The quorum, a heal if this group is behind, and the layout check, on a rank that
        runs a manager: what the job's other replicas are told (Note [jobs of different sizes])."""
        healed = self.last_heal
        try:
            self._snapshot = heal.snapshot(self._runtime, self._optimizers, scaler, self._layout)
            if self._diloco is not None:
                self._snapshot = self._diloco.snapshot(self._snapshot)
            self._transport.failed = None
            self._quorum()
            if self._transport.failed is not None:
                raise CannotHeal(
                    f"rank {self._place.rank} of group '{self.replica_id}' is behind and could not take "
                    f"a live group's state: {self._transport.failed}"
                ) from self._transport.failed
            weight = self._check_layout()
        except FaultToleranceError as e:
            return {"error": e}
        m = self._manager
        return {
            "error": None, "participants": m.num_participants(),
            "state": m.state_dict(), "weight": weight, "healed": self.last_heal is not healed,
        }

    def _share_heal(self, scaler) -> None:
        """The job's other replicas take the state its first replica healed to, rank for rank."""
        if self._place.replicas is None:
            return
        t0 = time.perf_counter()
        state, self._healed = self._place.tell(self._healed), None
        if self._manager is None:
            heal.apply(self._runtime, self._optimizers, scaler, state, self._layout, "the job's first replica")
            if self._diloco is not None:
                self._diloco.took()
            self.last_heal = Heal(self.step, _tensor_bytes(state), time.perf_counter() - t0)

    def _quorum(self) -> None:
        """``Manager.start_quorum`` on a thread of its own, while this one watches the
        lighthouse (Note [quorum at the start of the step])."""
        done: Future = Future()

        def run() -> None:
            try:
                self._manager.start_quorum()
                done.set_result(None)
            except BaseException as e:  # raised again below, on the training thread
                done.set_exception(e)

        threading.Thread(target=run, name="shardwise-ft-quorum", daemon=True).start()
        start, misses = time.monotonic(), 0
        while True:
            try:
                done.result(timeout=0.5)
                return
            except FutureTimeout:
                if time.monotonic() - start > 1.0:
                    misses = 0 if reachable(self.lighthouse) else misses + 1
                    if misses >= 2:
                        raise self._lost("stopped answering while this group waited for a quorum") from None
            except FaultToleranceError:
                raise
            except Exception as e:
                if not reachable(self.lighthouse):
                    raise self._lost(f"stopped answering ({type(e).__name__}: {e})") from e
                raise FaultToleranceError(
                    f"group '{self.replica_id}' got no quorum from the lighthouse at {self.lighthouse}: "
                    f"{type(e).__name__}: {e}"
                ) from e

    def _lost(self, what: str) -> LighthouseLost:
        return LighthouseLost(
            f"the lighthouse at {self.lighthouse} {what}: no group can form a quorum without it. "
            "Restart it, then the groups (a shardwise checkpoint resumes them: --resume)"
        )

    def _check_layout(self) -> float:
        """Every group must hold the same rows rank for rank: averaged over the groups, this
        rank's layout fingerprint stays itself only where all agree (one small all-reduce, which
        also averages the jobs' sizes). Returns this job's weight in the groups' average: its
        ranks over the mean of the groups' (Note [jobs of different sizes])."""
        if self._fingerprint is None:
            values = [*heal.fingerprint(self._layout), float(dist.get_world_size())]
            self._fingerprint = torch.tensor(values, dtype=torch.float64, device=groups.device())
        seen = self._fingerprint.clone()
        self._manager.allreduce(seen).wait()
        if self._manager.errored() is not None:
            return 1.0  # (the step will not commit)
        if not torch.equal(seen[:-1], self._fingerprint[:-1]):
            raise CannotHeal(
                f"group '{self.replica_id}' does not shard the model as the other groups in the "
                f"quorum do (rank {self._place.rank} of {self._place.size}, strategy "
                f"'{self._runtime.sharding.value}'). {heal._FIX}"
            )
        return self._fingerprint[-1].item() / seen[-1].item()

    def commit(self) -> bool:
        """Whether this step commits on this group (torchft's vote over its ranks)."""
        if not self._in_step:
            raise ShardwiseError("opt.step() without opt.zero_grad() first: zero_grad joins the step's quorum")
        self._in_step = False
        vote = None
        if self._manager is not None:
            vote = {"committed": self._manager.should_commit(), "state": self._manager.state_dict()}
        vote = self._place.tell(vote)
        self._told = {**self._told, "state": vote["state"]}
        self._committed = vote["committed"]
        self._failed = 0 if self._committed else self._failed + 1
        if self._failed > self.max_failed_steps:
            raise FaultToleranceError(
                f"group '{self.replica_id}' failed to commit {self._failed} steps in a row: "
                f"{(self._manager and self._manager.errored()) or 'too few groups in the quorum'} "
                f"(min_replicas={self.min_replicas})"
            )
        return self._committed

    # --- healing (torchft calls these)
    def _serve(self) -> dict:
        return self._snapshot

    def _take(self, state: dict) -> None:
        t0 = time.perf_counter()
        received = self._transport.received
        heal.apply(self._runtime, self._optimizers, self._runtime.grad_scaler, state, self._layout, received.source)
        if self._diloco is not None:
            self._diloco.took()
        if self._place.replicas is not None:  # the job's other replicas take it next (_share_heal)
            self._healed = state
        self.last_heal = Heal(self._manager.current_step(), received.bytes, received.seconds + time.perf_counter() - t0)
        log.info("rank %d healed: %s", dist.get_rank(), self.last_heal)


# Note [the first quorum heals rank by rank]: in the first quorum (no step committed yet)
# torchft's init_sync syncs the groups from a primary that it picks for each rank, not for each
# group: seen here, rank 1 of group 0 took group 1's state while rank 0 of group 0 kept its own
# and rank 0 of group 1 took it. Shards are per rank, so that is sound for them; the loss scale
# is the job's, and a group whose first step overflowed alone before the other joined holds
# another one. The job's ranks then scaled their losses differently and its reductions summed
# gradients of two scales, silently (tests/test_ft.py caught it as a run that no longer equals
# its replay). So until a step has committed, every rank takes its job's rank 0's loss scale
# after the quorum: rank 0 of every group holds the same primary's, so the groups agree too.
def _one_scale(scaler) -> None:
    """Every rank of the job takes rank 0's loss scaler state (Note [the first quorum heals
    rank by rank])."""
    state = [scaler.state_dict()]
    C.blocking("broadcast", "loss scale", dist.broadcast_object_list, state, src=0, group=groups.host_group(None))
    scaler.load_state_dict(state[0])


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


@dataclass(frozen=True)
class _Place:
    """Where this rank stands in torchft's view of its job (Note [jobs of different sizes]):
    its rank in its group (its shard index) of ``size``, whether it runs a manager (it is in
    the job's first replica), and with hybrid sharding the job's ranks of its shard index,
    whose first (the first replica's) tells the others what its manager decided."""

    rank: int
    size: int
    leads: bool
    replicas: dist.ProcessGroup | None

    @staticmethod
    def of(mesh: groups.Mesh, sharded: bool) -> _Place:
        if not sharded:  # no_shard: every rank a replica, rank 0's the first
            whole = mesh.shard if mesh.shard is not None else dist.group.WORLD
            alone = dist.get_world_size(whole) == 1
            return _Place(0, 1, dist.get_rank(whole) == 0, None if alone else whole)
        if mesh.replicate is None:
            return _Place(dist.get_rank(), dist.get_world_size(), True, None)
        shard, replicas = mesh.shard, mesh.replicate
        return _Place(dist.get_rank(shard), dist.get_world_size(shard), dist.get_rank(replicas) == 0, replicas)

    def tell(self, obj):
        """The first replica's ``obj`` on every replica of this shard index (``obj`` itself
        without hybrid sharding)."""
        if self.replicas is None:
            return obj
        box = [obj]
        src = dist.get_global_rank(self.replicas, 0)
        C.blocking("broadcast", "torchft outcome", dist.broadcast_object_list, box, src=src, group=groups.host_group(self.replicas))
        return box[0]

    def share(self, work, tensor: torch.Tensor):
        """The groups' average (``work``, on the first replica) of ``tensor``, on every replica
        of this shard index once waited for."""
        return work if self.replicas is None else _Shared(work, tensor, self.replicas)


class _Shared:
    def __init__(self, work, tensor: torch.Tensor, replicas: dist.ProcessGroup):
        self.work, self.tensor, self.replicas = work, tensor, replicas

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        C.broadcast(self.tensor, 0, self.replicas, "torchft average").wait()
        return True


@dataclass(frozen=True)
class _Received:
    bytes: int
    seconds: float
    source: str


class _Transport(HTTPTransport):
    """torchft's HTTP checkpoint transport, serving at an address other groups reach (torchft's
    names this machine by its hostname, which another node or namespace may not resolve), and
    noting what a heal received."""

    def __init__(self, host: str, timeout: timedelta):
        self._host = host
        self.received: _Received | None = None
        self.failed: Exception | None = None
        super().__init__(timeout=timeout, num_chunks=0)

    def address(self) -> str:
        port = self._server.socket.getsockname()[1]
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{port}/checkpoint/"

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta):
        t0 = time.perf_counter()
        try:
            state = super().recv_checkpoint(src_rank, metadata, step, timeout)
        except Exception as e:
            self.failed = e
            raise
        self.received = _Received(_tensor_bytes(state), time.perf_counter() - t0, f"{metadata}{step}")
        return state


def _tensor_bytes(obj) -> int:
    """Bytes of the distinct storages of the tensors in ``obj``."""
    seen: dict[int, int] = {}
    stack = [obj]
    while stack:
        o = stack.pop()
        if torch.is_tensor(o):
            s = o.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return sum(seen.values())

