"""``ShardOptions``: what ``shard()`` and ``checkpoint_activations()`` take, as one value, for the
framework integrations that shard a model on the user's behalf (``shardwise.lightning``,
``shardwise.hf``). One place turns it into calls of the core, so both frameworks shard alike."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch.distributed as dist
import torch.nn as nn

from .api import shard
from .core import wrap as wraps
from .core.errors import ShardwiseError
from .core.placement import Placement
from .core.policies import Comm, MixedPrecision, Sharding
from .core.recompute import checkpoint_activations

Classes = Collection[type[nn.Module]]


@dataclass(frozen=True)
class ShardOptions:
    """How a framework integration shards the model it is given.

    wrap: a wrap policy, or a set of module classes (``{Block}``: ``wrap.by_class(Block)``);
    None: ``wrap.auto(model)``. strategy (None: full_shard, or the plan's with a budget),
    mixed_precision, cpu_offload, placement, comm,
    max_unsharded, shard_size: as for ``shard()``. memory_budget: bytes or "20GiB": the
    planner picks each unit's settings to fit (``shardwise.plan(..., budget=...)``), with the
    example inputs the framework provides. activation_checkpointing: a policy or a set of
    module classes whose activations are recomputed in backward (not with memory_budget,
    whose plan decides that per unit).
    """

    wrap: wraps.Policy | Classes | None = None
    strategy: str | None = None  # shard()'s default, full_shard; a budget's plan chooses
    mixed_precision: MixedPrecision | str | None = None
    cpu_offload: bool = False
    placement: Placement | None = None
    comm: Comm | str | None = None
    max_unsharded: int = 2
    shard_size: int | None = None
    memory_budget: int | str | None = None
    activation_checkpointing: wraps.Policy | Classes | None = None

    def __post_init__(self) -> None:
        Sharding.of(self.strategy or "full_shard")  # each raises, naming the value, now
        MixedPrecision.of(self.mixed_precision)
        Comm.of(self.comm)
        if self.memory_budget is not None and self.activation_checkpointing is not None:
            raise ShardwiseError(
                "memory_budget and activation_checkpointing were both given: with a budget the "
                "planner decides which units recompute their activations; pass one of them"
            )
        if self.memory_budget is not None and self.cpu_offload:
            raise ShardwiseError(
                "memory_budget and cpu_offload=True were both given: with a budget the planner "
                "decides which units' state is offloaded; pass one of them"
            )


def mixed_precision_of(
    option: MixedPrecision | str | None, flag: str | None, asks: MixedPrecision | str | None, *, owner: str
) -> MixedPrecision | str | None:
    """shard()'s mixed precision where a framework has a precision setting of its own:
    ``option``, the ``mixed_precision`` given to ``owner`` (None: not given), and ``asks``, what
    the framework's ``flag`` stands for (``flag`` as the user wrote it; None: left at its default).
    Either alone decides; both must agree, else the error names both."""
    if option is None:
        return asks
    if flag is not None and MixedPrecision.of(option) != MixedPrecision.of(asks):
        raise ShardwiseError(f"{owner}(mixed_precision={option!r}) and {flag} disagree: set one of them")
    return option


def policy_of(spec: wraps.Policy | Classes | None, model: nn.Module) -> wraps.Policy:
    """A wrap policy from a policy, a collection of module classes, or None (``wrap.auto``)."""
    if spec is None:
        return wraps.auto(model)
    if isinstance(spec, Collection) and not isinstance(spec, (str, bytes)):
        return wraps.by_class(*spec)
    if callable(spec):
        return spec
    raise ShardwiseError(
        f"wrap/activation_checkpointing={spec!r}: give a policy (shardwise.wrap.by_class(...), "
        "by_size(...), a callable(module, name) -> bool) or a set of module classes"
    )


def is_sharded(model: nn.Module) -> bool:
    """Whether ``shard()`` already ran on ``model``."""
    return getattr(model, "_shardwise", None) is not None


def shard_with(
    model: nn.Module,
    options: ShardOptions,
    *,
    mixed_precision: MixedPrecision | str | None,
    example_inputs: Callable[[], tuple] | None = None,
) -> nn.Module:
    """Shard ``model`` in place as ``options`` say, in ``mixed_precision`` (the framework's
    precision setting, already reconciled with ``options.mixed_precision``).

    example_inputs: a function returning one micro-batch of positional arguments of
    ``model``'s forward, for ``memory_budget`` (the planner calls it under FakeTensorMode).
    """
    policy = policy_of(options.wrap, model)
    common = dict(
        mixed_precision=mixed_precision, placement=options.placement, comm=options.comm,
        max_unsharded=options.max_unsharded, shard_size=options.shard_size,
    )
    if options.memory_budget is None:
        shard(model, wrap=policy, strategy=options.strategy, cpu_offload=options.cpu_offload, **common)
    else:
        if example_inputs is None:
            raise ShardwiseError(
                f"memory_budget={options.memory_budget!r} plans one training step, which needs an "
                "example micro-batch of the model's inputs: see the framework's documentation "
                "(docs/frameworks.md) for where it takes it from"
            )
        from .planner.plan import plan  # the planner is only needed here

        # (the frameworks' steps drop the model's output before backward: the HF Trainer's
        # compute_loss and Lightning's training_step return the loss alone)
        chosen = plan(
            model, world_size=dist.get_world_size(), strategy=options.strategy, wrap=policy,
            budget=options.memory_budget, inputs=example_inputs, holds_output=False, **common,
        )
        shard(model, plan=chosen, **common)
    if options.activation_checkpointing is not None:
        checkpoint_activations(model, policy_of(options.activation_checkpointing, model))
    return model
