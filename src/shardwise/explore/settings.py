"""The what-if settings of an explorer run, checked where they enter (the page's form)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_grad_op")
HYBRID_SHARD_SIZE = 2  # hybrid strategies: ranks per shard group (4 ranks: 2 replicas x 2 shards)
PRECISIONS = ("none", "bf16")
CODECS = ("none", "bf16", "fp8", "int8")
MAX_RANKS = 4
STAGES = 12  # a run's stages; each is STEPS_PER_STAGE optimizer steps
STEPS_PER_STAGE = 5


@dataclass(frozen=True)
class Settings:
    """One run's configuration, applied at Reset.

    ranks: rank processes, 1-4. strategy: shardwise's sharding (no_shard is DDP's layout; the
    hybrid ones shard within groups of HYBRID_SHARD_SIZE ranks and replicate across them, so
    they need at least two such groups).
    mixed_precision: "bf16" gathers and computes in bfloat16, or "none". cpu_offload: shards,
    gradients and optimizer state in host memory. activation_checkpointing: recompute each
    block's activations in backward. comm: the wire codec of gathers and reductions, or "none".
    """

    ranks: int = 2
    strategy: str = "full_shard"
    mixed_precision: str = "none"
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    comm: str = "none"

    def __post_init__(self) -> None:
        if not isinstance(self.ranks, int) or isinstance(self.ranks, bool) or not 1 <= self.ranks <= MAX_RANKS:
            raise ValueError(f"ranks must be a whole number from 1 to {MAX_RANKS}, got {self.ranks!r}")
        _choice("strategy", self.strategy, STRATEGIES)
        _choice("mixed_precision", self.mixed_precision, PRECISIONS)
        _choice("comm", self.comm, CODECS)
        for name in ("cpu_offload", "activation_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.hybrid and (self.ranks % HYBRID_SHARD_SIZE or self.ranks < 2 * HYBRID_SHARD_SIZE):
            raise ValueError(
                f"{self.strategy} shards within groups of {HYBRID_SHARD_SIZE} ranks and replicates across "
                f"at least two of them: it needs ranks = {2 * HYBRID_SHARD_SIZE} (2 replicas x {HYBRID_SHARD_SIZE} shards), "
                f"got ranks = {self.ranks}"
            )
        if self.cpu_offload and self.strategy == "no_shard":
            raise ValueError("cpu_offload needs a sharded strategy: choose full_shard or shard_grad_op")

    @classmethod
    def of(cls, given: dict[str, Any]) -> Settings:
        """Settings from the page's form; unknown names and bad values raise ValueError."""
        unknown = set(given) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown setting(s) {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**given)

    @property
    def hybrid(self) -> bool:
        return self.strategy.startswith("hybrid")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def shard_options(self) -> dict[str, Any]:
        """The arguments that ``shardwise.shard`` and ``shardwise.plan`` share."""
        return {
            "strategy": self.strategy,
            "mixed_precision": None if self.mixed_precision == "none" else self.mixed_precision,
            "cpu_offload": self.cpu_offload,
            "comm": None if self.comm == "none" else self.comm,
            **({"shard_size": HYBRID_SHARD_SIZE} if self.hybrid else {}),
        }


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
