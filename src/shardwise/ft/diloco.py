"""DiLoCo on the replica axis: each replica group (torchrun job) takes ``sync_every`` inner
steps with no traffic across groups, then the groups average their pseudo-gradients (the
global parameters at the round's start minus this group's parameters now) and an outer
optimizer (Nesterov SGD) moves the global parameters by that average.

Inside a job sharding is unchanged: rank r holds its shard of every parameter, and shard
index r of every group exchanges only its shard's pseudo-gradient (one flat buffer a round)
through torchft's ``Manager``, as the per-step average does (``Torchft.all_reduce``).

Note [a round is one torchft step]: a round ends with what a step of ``Torchft.optimizer``
does: the quorum (a group that is behind heals from a live one), the layout check, the
average through ``Manager.allreduce`` and the commit vote; torchft's step therefore counts
rounds (after a first one before any inner step, where every group takes the same
parameters), and ``ft.step`` counts inner steps: ``(rounds) * sync_every`` plus the inner
steps of this round. A group's first quorum is a round's end with no pseudo-gradient of its
own: it meets the live groups' round end, whichever it is, with the same collectives (where
no group contributes, as at a run's start, the global parameters stay). A round whose average fails does not commit: the group goes back
to the global parameters of its start and trains the round again (``ft.step`` goes back with
it, so the loop reads the same batches), as torchft's ``DiLoCo`` discards a failed sync.

Note [the global parameters are outer state]: the global parameters (each fragment's as its
last sync left them) are kept in the outer optimizer's state, as ``"global"`` beside its
momentum, so that a checkpoint of the outer optimizer holds them: with fragments the
parameters a checkpoint of the model holds are nowhere all global (each fragment trained
since its own sync), and a resumed run needs both. This module's entries (``OWN``, ft/fragment_sync.py) leave the
state while the outer optimizer steps (an optimizer such as Adam starts its state where it
finds it empty).

What a live group serves a joining one (ft/heal.py's snapshot) holds the global parameters
(not this group's inner ones, and not again in the outer state), the inner and the outer
optimizer's state. A group that healed
at a round's end takes no part in that round's average (it has no inner steps of its own in
it): it sends zeros and the others' average is taken over the groups that do
(``_contributing``), then it takes the same outer step as they do and trains the next round.

Note [error feedback across rounds]: with ``comm="int8"`` or ``"topk"`` each rank sends its
shard's pseudo-gradient encoded, after adding what encoding dropped from what it sent before
(its residual), and keeps what this message drops as the next residual: over rounds every
part of every pseudo-gradient is sent, late. The messages are all-gathered (each group's is
decoded and the average taken here), over the manager's process group. The residual is this
rank's own, kept in the outer optimizer's state (a checkpoint of the optimizers saves it); a
round that does not commit gives it back as it was, and a healed rank starts it from zero
(another group's residual holds what that group dropped of its own pseudo-gradients). A
rank that sits a sync out sends zeros and keeps its residual (a resumed run's first sync:
Note [resuming a checkpoint]).

Note [one global model]: a group's first quorum comes before its first inner step; if it
meets no live group there (they are in the middle of a round, and the lighthouse's join
timeout is shorter than what is left of it), it starts a round alone from its own parameters
and is not behind the others when it meets them at a round's end (its step may equal theirs).
Averaging its pseudo-gradient with theirs would move two different global models as one,
silently; so every round's end compares a checksum of each group's global parameters and a
difference ends the round with ``FaultToleranceError``, on every group, saying so.

Note [resuming a checkpoint]: a checkpoint is saved after a (fragment) sync, whose torchft
step S it records (``ft.state_dict()``). A run that loads it begins, as every run does, with a
sync before any inner step: that sync takes the count back to S - 1 first, so that it is the
saved sync again (the same fragment, torchft's step back at S, ``ft.step`` where it was
saved) rather than one more, which would skip a round's batches and, with fragments, set a
fragment back to its global parameters, losing what it trained since its sync. No group
contributes to it (the outer optimizer does not step) and each keeps its parameters, also
where it does not commit and is taken again (a run's first sync has no inner steps to undo).

Note [streaming DiLoCo]: with ``fragments`` F > 1 (Douillard et al., 2025, "Streaming
DiLoCo"; torchft's ``DiLoCo`` with fragments) a rank's parameters (its shards, in the inner
optimizer's order) are split into F contiguous runs of whole parameters, the same on every
rank of every group, and each run is synced on its own: every ``sync_every / F`` inner steps
one fragment's sync is one torchft step as above (quorum and heal, checksum, average of that
fragment's pseudo-gradient, commit, outer step of that fragment's global parameters), the
fragments in turn: the sync of torchft's step s takes fragment (s - 1) mod F, so a group that
healed at the quorum syncs the fragment the live groups do. A round of ``sync_every`` steps
therefore moves each fragment once and each sync 1/F of the bytes. With
``fragment_sync_delay`` D the sync is issued (quorum, pseudo-gradient, all-reduce started) D
inner steps before it is applied (wait, commit, outer step), so the all-reduce overlaps those
steps' compute; the fragment's parameters then trained D steps past the pseudo-gradient, and
take ``global + MIX * (local - global)`` with MIX = 1/2 (the paper's mixing, torchft's
``fragment_update_alpha`` = 1/2) rather than the bare global (which drops D steps of
training; with D = 0 they take the global). A group that healed at that sync's quorum
trained nothing past it (its parameters are the old global ones): it takes the bare global,
as mixing would take it halfway back to the old. A sync that does not commit puts the fragment
back to its global parameters (as torchft does; ``ft.step`` goes back ``sync_every / F``
steps). An encoded exchange (``comm``) overlaps them the same way: its messages are encoded
(and the residual kept) at the issue, their all-gather runs on the manager's process group
(torchft's Gloo or NCCL, apart from the job's groups, so it never meets the inner steps'
collectives) while the inner steps go on, and they are decoded at the apply, where an error
in flight is reported to the manager and the sync does not commit (never raised mid-step,
never a wait past the manager's timeout).

Built on torchft's ``Manager`` (quorum, allreduce, commit, heal) but not its ``DiLoCo``:
that one counts torchft's steps as rounds (scripts here count inner steps), holds whole
``nn.Module`` fragments (here each rank holds shards), and registers its own state with the
manager, which here serves shardwise's per-rank snapshot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from ..checkpoint.state import param_slots
from ..core.errors import ShardwiseError
from .feedback import Feedback, codec_of
from .fragment_sync import MIX, FragmentSync, fragments_of

if TYPE_CHECKING:
    from .heal import Snapshot
    from .steps import Steps

__all__ = ["MIX", "DiLoCo", "Done", "fragments_of", "nesterov", "outer_optimizer_of"]


class DiLoCo(FragmentSync):
    """The inner optimizer under DiLoCo (``Torchft.diloco``): ``zero_grad`` and ``step`` are
    the inner optimizer's (no traffic across groups), and every ``sync_every``-th ``step``
    ends the round (the module's docstring); returns whether that step's round committed
    (True on inner steps). Iterating it gives the inner optimizer, so ``shardwise.save(path,
    model, opt)`` saves the model and the inner optimizer, as for a plain optimizer; the outer
    optimizer (``opt.outer``, whose state holds the error feedback residuals) goes in a
    checkpoint of its own, ``shardwise.save(path2, model, opt.outer)``: a checkpoint names
    optimizer state by parameter, and both optimizers hold the same parameters. The outer
    state holds the global parameters too (Note [the global parameters are outer state]).
    Save after a (fragment) sync (``ft.step % (sync_every // fragments) == 0``) with
    ``ft.state_dict()``; resume by loading all three before the first step (Note [resuming
    a checkpoint])."""

    def __init__(
        self, ft: Steps, inner: torch.optim.Optimizer, sync_every: int, outer: torch.optim.Optimizer,
        comm: str | None, fragments: int = 1, fragment_sync_delay: int = 0,
    ):
        self.ft, self.inner, self.outer, self.sync_every = ft, inner, outer, sync_every
        self.local = 0  # inner steps taken since the last (fragment) sync
        self.params = [p for g in inner.param_groups for p in g["params"]]
        self.feedback = Feedback(codec_of(comm), outer, self.params) if comm is not None else None
        self.pieces = fragments_of(len(self.params), sync_every, fragments, fragment_sync_delay)
        self.every, self.delay = sync_every // fragments, fragment_sync_delay  # Note [streaming DiLoCo]
        self._pending: tuple | None = None  # the fragment sync issued and not yet applied
        self.names = {id(s.tensor): s.name for s in param_slots(ft.runtime)}
        for p in self.params:  # Note [the global parameters are outer state]
            self.outer.state[p]["global"] = p.detach().clone()
        self.sitting_out = False  # healed at this round's end: no pseudo-gradient of its own
        self._mismatch: str | None = None  # Note [one global model]
        self._anyone = False  # whether any group in the quorum contributed a pseudo-gradient
        self._started = False

    # --- the loop's calls
    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self._started and self.ft.rounds > 0:  # Note [resuming a checkpoint]
            state = self.ft.state_dict()
            self.ft.load_state_dict({**state, "step": state["step"] - 1})
        while not self._started:  # Note [a round is one torchft step]: a round's end before any step
            self.sitting_out = True  # (no inner steps yet: FaultToleranceError after max_failed_steps)
            self._issue()
            self._started = self._apply()
        self.inner.zero_grad(set_to_none)

    def step(self, closure=None) -> bool:
        if closure is not None:
            raise ShardwiseError("a DiLoCo step takes no closure")
        if not self._started:
            raise ShardwiseError("opt.step() without opt.zero_grad() first")
        self.inner.step()
        self.local += 1
        if self.local == self.every - self.delay:
            self._issue()
        return self._apply() if self.local == self.every else True

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter((self.inner,))

    def __len__(self) -> int:
        return 1

    # --- healing (Torchft's snapshot and take)
    def snapshot(self, served: Snapshot) -> Snapshot:
        """What a joining rank takes: ``served`` (ft/heal.py's snapshot) with the global
        parameters in place of this group's inner ones."""
        outer = served.optimizers[-1]  # (the globals travel once, as the parameters)
        outer = {**outer, "state": {n: {k: v for k, v in st.items() if k != "global"} for n, st in outer["state"].items()}}
        params = {self.names[id(p)]: b for p, b in zip(self.params, self._globals(self.params), strict=True)}
        return dataclasses.replace(served, params=params, optimizers=[*served.optimizers[:-1], outer])

    def took(self) -> None:
        """After a heal (the parameters are the live group's global ones): keep them as the
        global parameters and sit out this round's average."""
        for p in self.params:
            self.outer.state[p]["global"] = p.detach().clone()
            self.outer.state[p].pop("residual", None)  # (Note [error feedback across rounds])
        self.sitting_out = True


class Done:
    def wait(self) -> bool:
        return True


def nesterov(comm: str | None) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """DiLoCo's outer optimizer for messages ``comm``: Nesterov SGD, lr 0.7, momentum 0.9
    (Douillard et al., 2023); 0.8 with top-k's, whose error feedback sends what a message
    drops rounds late, which 0.9's longer memory piles up (docs/fault_tolerance.md, "Top-k's
    recipe")."""
    momentum = 0.8 if comm == "topk" else 0.9
    return lambda params: torch.optim.SGD(params, lr=0.7, momentum=momentum, nesterov=True)


def outer_optimizer_of(make: Callable, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """``outer_optimizer(params)``, checked."""
    outer = make(params)
    if not isinstance(outer, torch.optim.Optimizer):
        raise ShardwiseError(
            "outer_optimizer takes the parameters and returns a torch.optim optimizer, e.g. "
            "lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)"
        )
    return outer
