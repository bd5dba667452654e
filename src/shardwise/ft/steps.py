"""The fault-tolerant step on one rank, as ``Torchft`` (ft/replicas.py) runs it: the manager
started with the job, at ``zero_grad`` the quorum, a heal if this group is behind and the
layout check (``begin_step``), at ``step`` the vote (``commit``), and the two sides of a heal
that torchft calls (``_serve``, ``_take``). Its state is the ``Phase`` of the step and the
records of ft/quorum.py; ``Torchft`` adds the settings and what users call."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchft.manager import Manager

from ..checkpoint.state import param_slots
from ..core import collectives as C
from ..core import groups
from ..core.errors import ShardwiseError
from . import heal
from .across import Across
from .errors import CannotHeal, FaultToleranceError, LighthouseUnreachable
from .lighthouse import local_address
from .place import Place
from .quorum import (
    Joined,
    ManagerSettings,
    Phase,
    Quorum,
    Vote,
    check_layout,
    join,
    make_manager,
    wait_for_lighthouse,
)
from .transport import Transport, tensor_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Heal:
    """The last time this rank took a live rank's state."""

    step: int  # the committed step it resumed at
    bytes: int  # tensor bytes received (its shards, optimizer state, buffers, residuals)
    seconds: float  # from asking for the state to having it in place


class Steps(Across):
    """The step's machinery and state; ``Torchft`` sets the settings and the fields below."""

    lighthouse: str
    replica_id: str
    min_replicas: int
    timeout: float
    quorum_timeout: float
    hostname: str | None
    max_failed_steps: int
    last_heal: Heal | None
    _manager: Manager | None
    _transport: Transport | None
    _optimizers: list[torch.optim.Optimizer]
    _phase: Phase
    _failed: int  # steps in a row that did not commit
    _snapshot: heal.Snapshot | None  # what this rank serves a healing rank this step
    _kept: heal.Transient | None  # what a step that does not commit must undo
    _place: Place | None
    _quorum: Quorum  # the manager's (or the job's first replica's) last word
    _healed: heal.Snapshot | None  # the state this rank healed to, for the job's other replicas
    _holding: heal.Holding | None  # once the optimizers are known
    _fingerprint: torch.Tensor | None

    # --- the manager
    def _start_manager(self) -> None:
        """Start this rank's manager (collective over the job): rank 0 checks the lighthouse
        and starts the group's store and manager server first, then the other ranks of the
        job's first replica join them (Note [jobs of different sizes])."""
        rank = dist.get_rank()
        self._place = Place.of(self._runtime.mesh, self._runtime.sharding.shard)
        problem, store = self._start_first() if rank == 0 else ("", None)
        store = C.agree(problem, "torchft start", LighthouseUnreachable, group=groups.host_group(None), value=store)
        if rank != 0 and self._place.leads:
            self._manager, self._transport = make_manager(self._settings(), self._place, store, self._take, self._serve)

    def _start_first(self) -> tuple[str, tuple[str, int] | None]:
        problem = wait_for_lighthouse(self.lighthouse, self.timeout)
        if problem:
            return problem, None
        settings = self._settings()
        self._store = dist.TCPStore(settings.host, 0, is_master=True, wait_for_workers=False)
        store = (settings.host, self._store.port)
        try:
            self._manager, self._transport = make_manager(settings, self._place, store, self._take, self._serve)
        except Exception as e:  # the lighthouse went away in between, or refused us
            return f"the manager could not join the lighthouse at {self.lighthouse}: {e}", None
        return "", store

    def _settings(self) -> ManagerSettings:
        host = self.hostname or local_address(self.lighthouse)
        return ManagerSettings(self.lighthouse, self.replica_id, self.min_replicas, self.timeout, self.quorum_timeout, host)

    # --- one step
    def begin_step(self) -> None:
        """Join this step's quorum (heal if behind) and check that the groups match."""
        if not self._optimizers:
            raise ShardwiseError("wrap the optimizer first: opt = ft.optimizer(torch.optim.AdamW(...))")
        scaler = self._runtime.grad_scaler
        unvoted = self._phase is Phase.OPEN  # (Note [a step the groups did not vote on])
        if self._phase is Phase.FAILED or (unvoted and self._errored_in_job()):
            heal.restore_transient(self._runtime, scaler, self._kept)
        if self._holding is None:
            slots = param_slots(self._runtime)
            self._holding = heal.Holding.of(self._runtime, self._optimizers, slots, self._place.rank, self._place.size)
        joined: Joined = self._place.tell(self._lead_step(scaler) if self._manager is not None else None)
        if joined.error is not None:
            raise joined.error
        self._quorum = joined.quorum
        self._share_heal()
        if scaler is not None and self.step == 0:
            _one_scale(scaler)
        # after a heal its state is the step's start; else the snapshot's copies of the buffers are
        unchanged = self._snapshot.buffers if self._manager is not None and not joined.healed else None
        self._kept = heal.transient(self._runtime, scaler, unchanged)
        self._phase = Phase.OPEN

    def _lead_step(self, scaler) -> Joined:
        """The quorum, a heal if this group is behind, and the layout check, on a rank that
        runs a manager: what the job's other replicas are told (Note [jobs of different sizes])."""
        healed = self.last_heal
        try:
            self._snapshot = heal.snapshot(self._runtime, self._optimizers, scaler, self._holding)
            if self._diloco is not None:
                self._snapshot = self._diloco.snapshot(self._snapshot)
            self._transport.failed = None
            self._transport.disallow_checkpoint()  # (Note [a step the groups did not vote on])
            join(self._manager, self.lighthouse, self.replica_id)
            if self._transport.failed is not None:
                raise CannotHeal(
                    f"rank {self._place.rank} of group '{self.replica_id}' is behind and could not take "
                    f"a live group's state: {self._transport.failed}"
                ) from self._transport.failed
            weight = self._check_layout()
        except FaultToleranceError as e:
            return Joined(None, error=e)
        m = self._manager
        return Joined(Quorum(m.num_participants(), m.state_dict(), weight), self.last_heal is not healed)

    def _errored_in_job(self) -> bool:
        """Whether an all-reduce across groups failed on any rank of this job in the step now
        ending (collective over the job, so that its ranks undo the step together)."""
        mine = self.leads and self.errored()
        host = groups.host_group(None)
        if host is None:
            return mine
        flag = torch.tensor([float(mine)])
        C.all_reduce(flag, host, "torchft errored", op=dist.ReduceOp.MAX).wait()
        return bool(flag.item())

    def _check_layout(self) -> float:
        if self._fingerprint is None:
            values = [*self._holding.fingerprint(), float(dist.get_world_size())]
            self._fingerprint = torch.tensor(values, dtype=torch.float64, device=groups.device())
        detail = f"rank {self._place.rank} of {self._place.size}, strategy '{self._runtime.sharding.value}'"
        return check_layout(self._manager, self._fingerprint, f"group '{self.replica_id}'", detail)

    def commit(self) -> bool:
        """Whether this step commits on this group (torchft's vote over its ranks)."""
        if self._phase is not Phase.OPEN:
            raise ShardwiseError("opt.step() without opt.zero_grad() first: zero_grad joins the step's quorum")
        vote = Vote(self._manager.should_commit(), self._manager.state_dict()) if self._manager is not None else None
        vote = self._place.tell(vote)
        self._quorum = Quorum(self._quorum.participants, vote.state, self._quorum.weight)
        self._phase = Phase.COMMITTED if vote.committed else Phase.FAILED
        self._failed = 0 if vote.committed else self._failed + 1
        if self._failed > self.max_failed_steps:
            raise FaultToleranceError(
                f"group '{self.replica_id}' failed to commit {self._failed} steps in a row: "
                f"{(self._manager and self._manager.errored()) or 'too few groups in the quorum'} "
                f"(min_replicas={self.min_replicas})"
            )
        return vote.committed

    # --- healing: torchft calls _serve and _take on the first replica, which shares what it took
    def _serve(self) -> heal.Snapshot:
        return self._snapshot

    def _take(self, state: heal.Snapshot) -> None:
        t0 = time.perf_counter()
        received = self._transport.received
        self._heal_to(state, received.source)
        if self._place.replicas is not None:  # the job's other replicas take it next (_share_heal)
            self._healed = state
        self.last_heal = Heal(self._manager.current_step(), received.bytes, received.seconds + time.perf_counter() - t0)
        log.info("rank %d healed: %s", dist.get_rank(), self.last_heal)

    def _share_heal(self) -> None:
        """The job's other replicas take the state its first replica healed to in this
        quorum, if it did, rank for rank. Told at every quorum, healed or not: torchft heals
        rank by rank (Note [the first quorum heals rank by rank]), and the step check compares
        the broadcasts of every shard index, which must therefore issue the same ones."""
        if self._place.replicas is None:
            return
        t0 = time.perf_counter()
        state, self._healed = self._place.tell(self._healed), None
        if self._manager is None and state is not None:
            self._heal_to(state, "the job's first replica")
            self.last_heal = Heal(self.step, tensor_bytes(state), time.perf_counter() - t0)

    def _heal_to(self, state: heal.Snapshot, source: str) -> None:
        heal.apply(self._runtime, self._optimizers, self._runtime.grad_scaler, state, self._holding, source)
        if self._diloco is not None:
            self._diloco.took()


# Note [a step the groups did not vote on]: a step that the loss scaler skips (a gradient not
# finite) never reaches the vote, as opt.step() is not called, and two things then go wrong
# unless the next step's start makes up for them. (1) torchft withdraws what its checkpoint
# transport serves only at the vote, so a rank healing in the next quorum, at the same step,
# could fetch the skipped attempt's snapshot before this rank serves the new one: seen in the
# first quorums, where rank 0 of a group took a loss scale one halving old and the groups then
# averaged gradients of two scales, silently. So a rank that runs a manager withdraws it
# before every quorum; torchft's send serves the new snapshot. (2) A gradient that is not
# finite can be what a failed all-reduce across groups left (torchft: the tensor may be
# corrupted); that step failed, yet the scaler halved the scale and cleared the residuals of
# this group alone. So if any rank of the job saw a failure in such a step, the job undoes it
# as it undoes a step the vote failed.

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
    scaler.load_state_dict(C.broadcast_object(scaler.state_dict(), 0, groups.host_group(None), "loss scale"))


