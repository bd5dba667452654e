"""A fault-tolerant step as a rank that runs a torchft manager takes it: the records that
cross functions and ranks (the step's phase, the quorum, what the job's other replicas are
told, the vote), the manager's construction, the quorum watched against a lost lighthouse
(Note [quorum at the start of the step] in ft/replicas.py) and the layout check."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta

import torch
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

from ..core import groups
from .errors import CannotHeal, FaultToleranceError, LighthouseLost
from .heal import FIX
from .lighthouse import reachable
from .place import Place
from .transport import Transport


class Phase(enum.Enum):
    """Where the fault-tolerant step stands: ``zero_grad`` opens it, ``step`` commits it or
    not; a step that failed is undone outside the optimizer when the next one opens."""

    READY = "ready"  # no step opened since the last vote (or ever)
    OPEN = "open"  # joined this step's quorum: gradients average across the groups
    COMMITTED = "committed"
    FAILED = "failed"


@dataclass(frozen=True)
class Quorum:
    """What the manager said at the last quorum: the groups taking part, torchft's state
    (``step``: the committed steps; ``batches_committed``) and this job's weight in the
    groups' average (Note [jobs of different sizes])."""

    participants: int
    state: dict[str, int]
    weight: float = 1.0

    @property
    def step(self) -> int:
        return self.state["step"]


@dataclass(frozen=True)
class Joined:
    """What a rank that runs a manager tells the job's other replicas once it joined a step's
    quorum: the quorum and whether it healed, or the error every replica raises."""

    quorum: Quorum | None
    healed: bool = False
    error: FaultToleranceError | None = None


@dataclass(frozen=True)
class Vote:
    """Whether the step commits on this group, and torchft's state after the vote."""

    committed: bool
    state: dict[str, int]


@dataclass(frozen=True)
class ManagerSettings:
    """What a ``Torchft`` gives every manager it starts."""

    lighthouse: str
    replica_id: str
    min_replicas: int
    timeout: float
    quorum_timeout: float
    host: str


def make_manager(
    s: ManagerSettings, place: Place, store: tuple[str, int], take: Callable, serve: Callable
) -> tuple[Manager, Transport]:
    """A torchft manager for this rank (``take``/``serve``: the heal's two sides) and the
    transport it heals over."""
    seconds = timedelta(seconds=s.timeout)
    cuda = groups.device().type == "cuda"
    transport = Transport(s.host, seconds)
    manager = Manager(
        pg=ProcessGroupNCCL(timeout=seconds) if cuda else ProcessGroupGloo(timeout=seconds),
        load_state_dict=take,
        state_dict=serve,
        min_replica_size=s.min_replicas,
        use_async_quorum=False,  # Note [quorum at the start of the step]
        timeout=seconds,
        quorum_timeout=timedelta(seconds=s.quorum_timeout),
        connect_timeout=timedelta(seconds=min(10.0, s.timeout)),
        rank=place.rank,
        world_size=place.size,
        store_addr=store[0],
        store_port=store[1],
        lighthouse_addr=s.lighthouse,
        replica_id=s.replica_id,
        hostname=s.host,
        checkpoint_transport=transport,
    )
    return manager, transport


def wait_for_lighthouse(lighthouse: str, timeout: float) -> str:
    """"" once something answers at ``lighthouse``, else (after ``timeout`` seconds, at most
    10) what to do about it."""
    deadline = time.monotonic() + min(10.0, timeout)
    while not reachable(lighthouse):
        if time.monotonic() > deadline:
            return (
                f"no lighthouse answers at {lighthouse}: start one there (shardwise lighthouse, or "
                "torchft_lighthouse --min_replicas 1) or fix the address (TORCHFT_LIGHTHOUSE)"
            )
        time.sleep(0.2)
    return ""


def join(manager: Manager, lighthouse: str, replica_id: str) -> None:
    """``Manager.start_quorum`` on a thread of its own, while this one watches the
    lighthouse (Note [quorum at the start of the step])."""
    done: Future = Future()

    def run() -> None:
        try:
            manager.start_quorum()
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
                misses = 0 if reachable(lighthouse) else misses + 1
                if misses >= 2:
                    raise lost(lighthouse, "stopped answering while this group waited for a quorum") from None
        except FaultToleranceError:
            raise
        except Exception as e:
            if not reachable(lighthouse):
                raise lost(lighthouse, f"stopped answering ({type(e).__name__}: {e})") from e
            raise FaultToleranceError(
                f"group '{replica_id}' got no quorum from the lighthouse at {lighthouse}: {type(e).__name__}: {e}"
            ) from e


def lost(lighthouse: str, what: str) -> LighthouseLost:
    return LighthouseLost(
        f"the lighthouse at {lighthouse} {what}: no group can form a quorum without it. "
        "Restart it, then the groups (a shardwise checkpoint resumes them: --resume)"
    )


def check_layout(manager: Manager, fingerprint: torch.Tensor, group: str, detail: str) -> float:
    """Every group must hold the same rows rank for rank: averaged over the groups, this
    rank's ``fingerprint`` (``Holding.fingerprint`` and the job's ranks) stays itself only
    where all agree (one small all-reduce, which also averages the jobs' sizes). Returns this
    job's weight in the groups' average: its ranks over the mean of the groups' (Note [jobs of
    different sizes]). ``group`` and ``detail`` (its rank and strategy) name this one in the error."""
    seen = fingerprint.clone()
    manager.allreduce(seen).wait()
    if manager.errored() is not None:
        return 1.0  # (the step will not commit)
    if not torch.equal(seen[:-1], fingerprint[:-1]):
        raise CannotHeal(f"{group} does not shard the model as the other groups in the quorum do ({detail}). {FIX}")
    return fingerprint[-1].item() / seen[-1].item()
