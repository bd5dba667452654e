"""The replica groups outside the job as one rank sees them, for what ends a DiLoCo round
(ft/diloco.py): torchft's count of committed steps, this job's weight in the groups' average,
the average and the all-gather over the groups, and how the job's other replicas learn what
its first one's manager decided (Note [jobs of different sizes] in ft/replicas.py). ``Steps``
(so ``Torchft``) is one; the fields are theirs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from .quorum import Quorum

if TYPE_CHECKING:
    from torchft.manager import Manager

    from ..core.runtime import Runtime
    from .place import Place


class Across:
    """Read and call by DiLoCo; ``leads`` says whether this rank runs a torchft manager (the
    average, the all-gather and ``errored`` are that rank's; the others learn by ``tell``)."""

    replica_id: str
    _manager: Manager | None
    _place: Place | None
    _quorum: Quorum
    _runtime: Runtime

    @property
    def runtime(self) -> Runtime:
        """The sharded model's runtime."""
        return self._runtime

    @property
    def leads(self) -> bool:
        return self._manager is not None

    @property
    def rounds(self) -> int:
        """torchft's committed steps (under DiLoCo: (fragment) syncs, the first included)."""
        return self._manager.current_step() if self._manager is not None else self._quorum.step

    @property
    def participants(self) -> int:
        """Replica groups in the current quorum."""
        return self._manager.num_participants() if self._manager is not None else self._quorum.participants

    @property
    def weight(self) -> float:
        """This job's weight in the groups' average: its ranks over the groups' mean."""
        return self._quorum.weight

    def state_dict(self) -> dict[str, int]:
        """The committed step (and torchft's count of batches): save it with a checkpoint."""
        return self._manager.state_dict() if self._manager is not None else dict(self._quorum.state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume the step count of a checkpoint (``state_dict``) before the first step."""
        if self._manager is not None:
            self._manager.load_state_dict(state)
        self._quorum = Quorum(self._quorum.participants, dict(state), self._quorum.weight)

    def tell(self, obj):
        """The job's first replica's ``obj`` on every replica of this shard index."""
        return self._place.tell(obj)

    def average(self, tensor: torch.Tensor, reduce_op=dist.ReduceOp.AVG):
        """``Manager.allreduce`` of ``tensor`` over the groups (a rank that leads): errors
        are reported to the manager (the step does not commit), not raised."""
        return self._manager.allreduce(tensor, reduce_op=reduce_op)

    def gather(self, message: torch.Tensor) -> Gathering:
        """Every group's ``message`` (same size everywhere) over the manager's process group
        (a rank that leads; torchft's Manager has no all-gather of its own), issued: its
        ``wait`` gives them, or None where this step met an error already or meets one there
        (reported, as ``average`` does: the step does not commit)."""
        m = self._manager
        if m.errored() is not None:
            return Gathering(m, None, [])
        received = [torch.empty_like(message) for _ in range(m.num_participants())]
        try:
            work = m._pg.allgather([received], [message], AllgatherOptions())
        except Exception as e:  # (a group lost in the round)
            m.report_error(e)
            return Gathering(m, None, [])
        return Gathering(m, work, received)

    def errored(self) -> bool:
        """Whether this step met an error across the groups (a rank that leads)."""
        return self._manager.errored() is not None

    def followed(self, work, tensor: torch.Tensor) -> None:
        """Wait for ``work`` (the leading rank's average into ``tensor``), then hand the
        result to the job's other replicas of this shard index."""
        if self._place.replicas is not None:
            self._place.share(work, tensor).wait()
        elif work is not None:
            work.wait()


class Gathering:
    """An all-gather over the groups in flight (``Across.gather``); ``work`` None: failed."""

    def __init__(self, manager: Manager, work, received: list[torch.Tensor]):
        self.manager, self.work, self.received = manager, work, received

    def wait(self) -> list[torch.Tensor] | None:
        if self.work is None:
            return None
        try:
            self.work.wait()
        except Exception as e:  # (a group lost while it was in flight)
            self.manager.report_error(e)
            return None
        return self.received
