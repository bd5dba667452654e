"""A (fragment) sync's two halves, as ``DiLoCo`` (ft/diloco.py) takes them: the issue (the
quorum, this fragment's pseudo-gradient, the groups' average started) and the apply (its
wait, the commit, the outer step of the fragment's global parameters, mixed with the local
ones after a delay), with the checks of the round's end (who contributes, one global model)
and the fragments' schedule. The Notes are ft/diloco.py's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..core.errors import ShardwiseError
from .errors import FaultToleranceError

if TYPE_CHECKING:
    from .feedback import Feedback
    from .steps import Steps


class FragmentSync:
    """The fields are ``DiLoCo``'s: ``ft``, the optimizers, the parameters and their
    fragments (``pieces``), the steps (``every``, ``delay``, ``local``) and the sync's state."""

    ft: Steps
    outer: torch.optim.Optimizer
    params: list[torch.Tensor]
    feedback: Feedback | None
    pieces: list[range]
    every: int
    delay: int
    local: int
    sitting_out: bool
    _pending: tuple | None
    _mismatch: str | None
    _anyone: bool
    _started: bool

    def _issue(self) -> None:
        """A (fragment) sync's start: the quorum, then the average of this fragment's
        pseudo-gradient, issued (``_apply`` waits for it)."""
        ft = self.ft
        ft.begin_step()  # the quorum: a group behind heals here (took)
        piece = self.pieces[(ft.rounds - 1) % len(self.pieces)]  # (the same on every group of the quorum)
        residual_before = self.feedback.residual(piece) if self.feedback is not None else None
        flat = self._pseudo_gradient(piece)
        share = self._contributing()
        # (the job's other replicas learn it from the first)
        mismatch, anyone = ft.tell((self._mismatch, self._anyone) if share is not None else None)
        if mismatch is not None:
            raise FaultToleranceError(mismatch)
        work = None
        if share is not None:
            flat.mul_(share)
            if self.feedback is None:
                work = ft.average(flat)
            else:  # (in flight over the delay's inner steps too: Note [streaming DiLoCo])
                work = self.feedback.exchange(ft, flat, piece, self.sitting_out)
        self._pending = (piece, flat, work, anyone, residual_before)

    def _apply(self) -> bool:
        """A (fragment) sync's end: wait for the average, commit, and step the fragment's
        global parameters with the outer optimizer; whether it committed."""
        ft = self.ft
        piece, flat, work, anyone, residual_before = self._pending
        self._pending = None
        ft.followed(work, flat)  # (the job's other replicas take the first's)
        committed = ft.commit()
        if not committed and self.feedback is not None:  # (the residual as the sync found it)
            self.feedback.set_residual(residual_before, piece)
        self.local = 0
        params = [self.params[i] for i in piece]
        backup = self._globals(params)
        with torch.no_grad():
            mixed = self.delay and committed and anyone and not self.sitting_out  # (Note [streaming DiLoCo])
            trained = [p.detach().clone() for p in params] if mixed else None
            if self._started and (anyone or not committed):  # (Note [resuming a checkpoint])
                for p, b in zip(params, backup, strict=True):
                    p.copy_(b)
            if committed and anyone:  # (where no group contributed, the global parameters stay)
                for p in self.params:  # (only the fragment's parameters step)
                    p.grad = None
                offset = 0
                for p in params:
                    p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.dtype)
                    offset += p.numel()
                kept = [{k: self.outer.state[p].pop(k) for k in OWN if k in self.outer.state[p]} for p in params]
                self.outer.step()  # (without this module's entries: an optimizer that starts its state where it is empty)
                for p, own in zip(params, kept, strict=True):
                    self.outer.state[p].update(own)
                self.outer.zero_grad(set_to_none=True)
                for p, b in zip(params, backup, strict=True):
                    b.copy_(p)
                if trained is not None:  # Note [streaming DiLoCo]: the late global mixed with the local
                    for p, t in zip(params, trained, strict=True):
                        p.lerp_(t, MIX)
        self.sitting_out = False
        return committed

    def _pseudo_gradient(self, piece: range) -> torch.Tensor:
        """The fragment's global parameters minus this group's, flat in fp32 (zeros where it
        sits out)."""
        params = [self.params[i] for i in piece]
        backup = self._globals(params)
        total = sum(p.numel() for p in params)
        flat = torch.zeros(total, dtype=torch.float32, device=params[0].device if params else None)
        if not self.sitting_out:
            offset = 0
            for p, b in zip(params, backup, strict=True):
                flat[offset : offset + p.numel()].copy_((b.float() - p.detach().float()).flatten())
                offset += p.numel()
        return flat

    def _globals(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The global parameters of ``params`` (Note [the global parameters are outer state]);
        where a loaded outer state has none (saved before it held them, at a round's end with
        one fragment), the parameters themselves, which were the global ones there."""
        for p in params:
            if "global" not in self.outer.state[p]:
                self.outer.state[p]["global"] = p.detach().clone()
        return [self.outer.state[p]["global"] for p in params]

    def _contributing(self) -> float | None:
        """On a rank that runs a manager: the factor on its pseudo-gradient, so that the
        groups' average is taken over those that contribute, each weighted by its ranks (Note
        [jobs of different sizes]); None elsewhere."""
        ft = self.ft
        if not ft.leads:
            return None
        mine = 0.0 if self.sitting_out else ft.weight
        seen = torch.tensor([mine], dtype=torch.float64)
        ft.average(seen).wait()
        self._mismatch, self._anyone = self._check_global(), seen.item() > 0
        return mine / seen.item() if seen.item() > 0 else 0.0

    def _check_global(self) -> str | None:
        """Note [one global model]: every group in the quorum must hold the same global
        parameters; a checksum of them, as its largest and smallest over the groups (one
        all-reduce of two numbers), says whether they do."""
        total = sum((b.double().sum() for b in self._globals(self.params)), torch.zeros((), dtype=torch.float64))
        seen = torch.stack([total, -total])
        self.ft.average(seen, reduce_op=dist.ReduceOp.MAX).wait()
        if not self.ft.errored() and seen[0] != -seen[1]:
            return (
                f"group '{self.ft.replica_id}' holds other global parameters than another group of "
                "this round's quorum (a group that joined during the first round, or whose first "
                "quorum met no live group, started a round of its own): stop that group and start "
                "it again after the others' next round has begun, or raise the lighthouse's join "
                "timeout above a round's duration (shardwise lighthouse --join-timeout-ms)"
            )
        return None


OWN = ("residual", "global")  # this module's entries in the outer optimizer's state
MIX = 0.5  # Note [streaming DiLoCo]: a late fragment's parameters, halfway between global and local


def fragments_of(pieces: int, sync_every: int, fragments: int, delay: int) -> list[range]:
    """The fragments of a rank's parameters (``pieces`` of them, in the inner optimizer's
    order): ``fragments`` contiguous runs, as even as whole parameters allow, checked against
    the round (``sync_every`` inner steps) and ``delay`` (Note [streaming DiLoCo])."""
    call = f"ft.diloco(sync_every={sync_every}, fragments={fragments!r}, fragment_sync_delay={delay!r})"
    if not isinstance(fragments, int) or fragments < 1:
        raise ShardwiseError(f"{call}: fragments is the number of parts synced in turn, an int >= 1")
    if fragments > pieces:
        raise ShardwiseError(
            f"{call}: a fragment holds whole parameters and this rank holds {pieces}: pass fragments <= {pieces}"
        )
    if sync_every % fragments:
        raise ShardwiseError(f"{call}: each fragment syncs every sync_every / fragments steps: make sync_every a multiple of fragments")
    if not isinstance(delay, int) or not 0 <= delay < sync_every // fragments:
        raise ShardwiseError(
            f"{call}: a fragment's average is applied fragment_sync_delay inner steps after it is "
            f"issued, before the next fragment's: an int in [0, sync_every / fragments = {sync_every // fragments})"
        )
    return [range(i * pieces // fragments, (i + 1) * pieces // fragments) for i in range(fragments)]
