"""The named ends of fault-tolerant training: each says what happened and what to do."""

from __future__ import annotations

from ..core.errors import ShardwiseError


class FaultToleranceError(ShardwiseError):
    """Training across replica groups cannot go on (the message says why and the fix)."""


class LighthouseUnreachable(FaultToleranceError):
    """At start: no lighthouse answers at the address given."""


class LighthouseLost(FaultToleranceError):
    """Mid-run: the lighthouse stopped answering, so no quorum can form."""


class CannotHeal(FaultToleranceError):
    """A group that joins could not take a live group's state: the transfer failed, or the
    groups' layouts differ (ranks, strategy, wrap, placement or optimizers)."""
