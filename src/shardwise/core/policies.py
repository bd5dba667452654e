"""Policies: precision (which dtype each tensor of a unit is stored, computed, sent and reduced
in), precision on the wire (``Comm``), sharding (what a strategy name means) and per-unit
settings (what a plan decides)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from enum import Enum

import torch

from .codecs import FORMATS as WIRE_FORMATS
from .codecs import Codec
from .errors import ShardwiseError


@dataclass(frozen=True)
class MixedPrecision:
    """Shards (and so the optimizer's parameters and state) stay in their own dtype, the
    master copy; each unit is gathered in ``param_dtype``, computes in it, and reduces its
    gradients in ``reduce_dtype`` before they land on the shards in the shards' dtype.

    param_dtype: gather and compute dtype (None: the parameters' own dtype).
    reduce_dtype: gradient reduction dtype (None: ``param_dtype``).
    buffer_dtype: dtype buffers are kept in (None: unchanged).
    output_dtype: the root module's floating-point outputs are cast to it (None: unchanged).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None

    @staticmethod
    def of(spec: MixedPrecision | str | None) -> MixedPrecision:
        """Resolve a policy or a shorthand: "bf16" / "fp16" (16-bit compute, fp32 reduction)."""
        if isinstance(spec, MixedPrecision):
            return spec
        shorthands = {
            None: MixedPrecision(),
            "none": MixedPrecision(),
            "fp32": MixedPrecision(),
            "bf16": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            "fp16": MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32),
        }
        if spec not in shorthands:
            raise ShardwiseError(
                f"mixed_precision={spec!r}: use 'bf16', 'fp16', None or a shardwise.MixedPrecision"
            )
        return shorthands[spec]

    def compute_dtype(self, storage: torch.dtype) -> torch.dtype:
        return self.param_dtype or storage

    def reduction_dtype(self, storage: torch.dtype) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype or storage

    @property
    def needs_loss_scaling(self) -> bool:
        return torch.float16 in (self.param_dtype, self.reduce_dtype)


@dataclass(frozen=True)
class Comm:
    """Precision on the wire, per collective: what a message is encoded in just before it
    leaves a rank and decoded from just after it arrives (shardwise.core.codecs). Master weights,
    gradients as they land and optimizer state keep their dtype; sums are taken in fp32.

    gather: the parameters' all-gather. Every rank, the shard's own one included, computes on
    the decoded values, so all ranks hold identical full parameters. Weights are encoded
    afresh from the master copy at every gather, so their rounding never accumulates.
    reduce: the gradients' reduce-scatter (or no_shard's all-reduce): each rank sends each
    other rank its encoded row, and each sums the decoded rows in fp32 (an all-to-all, not a
    ring that would encode again at every hop).
    replicate: hybrid sharding's all-reduce across shard groups (the link between nodes): a
    reduce-scatter as above, then a gather of the encoded sums.
    Each is None (exact: the dtype itself), "bf16", "fp8" (e4m3, per-block scales) or "int8"
    (per-block scales); ``gather_codec``, ``reduce_codec`` and ``replicate_codec`` are their
    codecs (shardwise.core.codecs), resolved once here.
    error_feedback: keep what encoding dropped from each gradient row this rank sent and add
    it to the next step's row, so rounding errors are delayed rather than lost (the residual
    is saved in checkpoints).
    """

    gather: str | None = None
    reduce: str | None = None
    replicate: str | None = None
    error_feedback: bool = False
    gather_codec: Codec | None = field(init=False, repr=False, compare=False)
    reduce_codec: Codec | None = field(init=False, repr=False, compare=False)
    replicate_codec: Codec | None = field(init=False, repr=False, compare=False)
    replica: InitVar[str | None] = None  # the old name of ``replicate`` (goes in 0.3)

    def __post_init__(self, replica: str | None):
        if replica is not None:
            warnings.warn(
                "Comm(replica=...) is now Comm(replicate=...) (hybrid sharding's replicate dimension; "
                "replica groups are jobs that train together); the old keyword goes in 0.3",
                DeprecationWarning,
                stacklevel=3,
            )
            if self.replicate is not None:
                raise ShardwiseError("Comm(replica=..., replicate=...): give replicate= alone")
            object.__setattr__(self, "replicate", replica)
        for kind in ("gather", "reduce", "replicate"):
            value = getattr(self, kind)
            if value is not None and value not in WIRE_FORMATS:
                raise ShardwiseError(
                    f"Comm({kind}={value!r}): use one of {WIRE_FORMATS}, or None for exact"
                )
            object.__setattr__(self, f"{kind}_codec", None if value is None else Codec(value))

    @staticmethod
    def of(spec: Comm | str | None) -> Comm:
        """Resolve a policy or a shorthand: "bf16", "fp8" or "int8" for every collective;
        None or "exact": no encoding."""
        if isinstance(spec, Comm):
            return spec
        if spec is None or spec == "exact":
            return Comm()
        if spec not in WIRE_FORMATS:
            raise ShardwiseError(
                f"comm={spec!r}: use one of {WIRE_FORMATS}, 'exact', None or a "
                "shardwise.Comm(gather=..., reduce=..., replicate=...)"
            )
        return Comm(gather=spec, reduce=spec, replicate=spec)

    @property
    def exact(self) -> bool:
        return self.gather is None and self.reduce is None and self.replicate is None


class Sharding(str, Enum):
    """A sharding strategy: its user-facing name (what ``shard(strategy=...)``, the CLI and
    checkpoints spell) and what it means, as three facts (FSDP2 describes the same space with
    its ``reshard_after_forward`` and a 1-D or 2-D mesh). Code asks the facts, never the name.

    A ``str`` enum, so that the name is the value: it prints, serialises (JSON, checkpoint
    metadata) and compares as the name users wrote.
    """

    shard: bool  # parameters sharded over the shard group (False: whole on every rank, DDP)
    reshard_after_forward: bool  # full parameters freed after each forward, gathered again
    hybrid: bool  # replicated across shard groups: gradients all-reduced across them

    #                       name                    shard  reshard  hybrid
    FULL_SHARD = ("full_shard", True, True, False)
    SHARD_GRAD_OP = ("shard_grad_op", True, False, False)
    NO_SHARD = ("no_shard", False, False, False)
    HYBRID_SHARD = ("hybrid_shard", True, True, True)
    HYBRID_SHARD_GRAD_OP = ("hybrid_shard_grad_op", True, False, True)

    def __new__(cls, name: str, shard: bool, reshard_after_forward: bool, hybrid: bool) -> Sharding:
        member = str.__new__(cls, name)
        member._value_ = name
        member.shard, member.reshard_after_forward, member.hybrid = shard, reshard_after_forward, hybrid
        return member

    __str__ = str.__str__  # the name, as a plain string would print
    __format__ = str.__format__

    @classmethod
    def of(cls, strategy: Sharding | str) -> Sharding:
        """The strategy a name means (the one place names are parsed)."""
        if isinstance(strategy, Sharding):
            return strategy
        try:
            return cls(strategy)
        except ValueError:
            raise ShardwiseError(f"strategy={strategy!r} is not one of {STRATEGIES}") from None


STRATEGIES = tuple(s.value for s in Sharding)  # the names, for argparse and messages


class Recompute(str, Enum):
    """What a unit recomputes in backward instead of keeping from forward (``UnitConfig``'s
    ``checkpoint``): a ``str`` enum like ``Sharding``, so that it prints, serialises and
    compares as the name users write."""

    NONE = "none"  # keeps every activation
    SELECTIVE = "selective"  # keeps the outputs of matrix products and attention
    FULL = "full"  # recomputes the module's whole forward (torch.utils.checkpoint)

    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def of(cls, spec: Recompute | str) -> Recompute:
        try:
            return cls(spec)
        except ValueError:
            raise ShardwiseError(f"UnitConfig(checkpoint={spec!r}): use 'none', 'selective' or 'full'") from None


@dataclass(frozen=True)
class UnitConfig:
    """How one unit runs: the settings a plan chooses per unit and ``shard(plan=...)`` applies.

    reshard_after_forward: free the unit's full parameters after its forward and gather them
    again for backward (full_shard), or keep them to backward (shard_grad_op). The root never
    reshards after forward (backward needs it first).
    checkpoint: a ``Recompute`` or its name: "full" recomputes the unit's activations in
    backward (its module's forward under torch.utils.checkpoint); "selective" keeps the outputs
    of its matrix products and attention and recomputes the rest; "none" keeps them all.
    offload: the unit's parameter shards, their gradients and so its optimizer state live in
    host memory (``cpu_offload`` for this unit alone).
    offload_activations: the activations the unit's forward saves for backward wait in host
    memory, and come back ahead of its backward (activation_offload.py); not with checkpointing.
    """

    reshard_after_forward: bool = True
    checkpoint: Recompute = Recompute.NONE
    offload: bool = False
    offload_activations: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "checkpoint", Recompute.of(self.checkpoint))  # (a name too)
        if self.offload_activations and self.checkpoint is not Recompute.NONE:
            raise ShardwiseError(
                f"UnitConfig(checkpoint={self.checkpoint.value!r}, offload_activations=True): a unit "
                "either recomputes its activations or offloads them; choose one"
            )


@dataclass(frozen=True)
class Settings:
    """What ``shard(model, plan=...)`` applies as it is: the strategy, the wrap policy and one
    ``UnitConfig`` per unit, by unit name ("" for the root; every unit named, innermost first).
    The planner makes one (``shardwise.plan(...).settings``); so can a user."""

    strategy: Sharding  # (a name is parsed on creation)
    wrap: Callable[[object, str], bool] | None
    units: tuple[tuple[str, UnitConfig], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", Sharding.of(self.strategy))

    def of(self, name: str) -> UnitConfig:
        for n, c in self.units:
            if n == name:
                return c
        raise ShardwiseError(
            f"the plan has no settings for unit '{name or '<root>'}' (it names "
            f"{[n or '<root>' for n, _ in self.units]}): plan the model you shard, with the "
            "same wrap policy"
        )
