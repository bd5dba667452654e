"""The public functions: shard a model, accumulate without sync, clip, full state dicts."""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterator
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .checkpoint import load_full
from .core import collectives as C
from .core import flight, groups, optimizer_guard
from .core import placement as placements
from .core.build import broadcast_from_rank0, build
from .core.errors import ShardwiseError
from .core.policies import Comm, MixedPrecision, Settings, Sharding
from .core.replica_groups import ReplicaGroups
from .core.runtime import require_idle, runtime_of
from .core.unit import ShardedUnit, Unit
from .core.wrap import Policy

Strategy = Literal["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_grad_op"]  # Sharding's names


def shard(
    module: nn.Module,
    *,
    wrap: Policy | None = None,
    strategy: Strategy | Sharding | None = None,
    group: dist.ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
    shard_size: int | None = None,
    init: Callable[[nn.Module], None] | None = None,
    mixed_precision: MixedPrecision | str | None = None,
    cpu_offload: bool = False,
    max_unsharded: int = 2,
    init_from: str | os.PathLike | None = None,
    placement: placements.Placement | None = None,
    comm: Comm | str | None = None,
    plan: Settings | None = None,
    fault_tolerance: ReplicaGroups | None = None,
) -> nn.Module:
    """Shard ``module`` in place over the ranks of ``group`` (default: the world); return it.

    The wrap policy picks units (innermost first; the root takes the rest); each unit's
    parameters are laid out in one flat buffer and this rank keeps only its 1/N rows of each.
    Afterwards ``module.parameters()`` yields this rank's shards, so build the optimizer from
    them after this call. Values come from rank 0; a module built on the meta device is
    initialised here one module at a time (``reset_parameters()`` or ``init(module)``).

    strategy: "full_shard" (the default) frees full parameters after each unit's forward and gathers them
    again for backward; "shard_grad_op" keeps them from forward to backward; "no_shard" keeps
    whole parameters on every rank and all-reduces gradients (DDP; without mixed precision the
    gradients are views of a bucket the next step reduces into, as with DDP's
    ``gradient_as_bucket_view``: clone one to keep it). ``max_unsharded`` bounds
    how many units (besides the root) full_shard keeps gathered at once, prefetch included;
    consecutive small units that share one gather (a bucket of units, at most 4 MiB) count
    as one.

    mixed_precision: "bf16" / "fp16" (16-bit gather and compute, fp32 gradient reduction) or a
    ``MixedPrecision``; shards and optimizer state stay in the parameters' dtype (fp16 needs a
    ``shardwise.GradScaler``). cpu_offload: shards, their gradients and optimizer state live in
    host memory; each unit is copied to the device just before its gather.

    placement: ``callable(name, param) -> "rows" | "owned"`` for the parameters of wrapped
    units (default: all rows). An owned parameter is held whole by one rank, which then holds
    its gradient and optimizer state whole too: optimizers that need whole matrices (Muon,
    Adafactor) are exact with ``shardwise.placement.matrices``. Owners are chosen largest
    first, each to the least-loaded rank of the shard group.

    comm: precision on the wire: "bf16", "fp8" (e4m3) or "int8" for every gather and
    reduction, or ``shardwise.Comm(gather=..., reduce=..., replicate=..., error_feedback=...)``
    for each apart (``replicate``: hybrid sharding's all-reduce across shard groups, the link
    between nodes). fp8 and int8 scale each block of 256 elements by its absolute maximum;
    sums are taken in fp32; master weights and optimizer state keep their dtype. Default:
    exact (the gather and reduction dtypes themselves).

    plan: what ``shardwise.plan(..., budget=...)`` chose (a ``Plan`` or its ``.settings``, a
    ``policies.Settings``): its wrap policy, strategy and per-unit settings are applied as
    they are (``UnitConfig``: reshard after forward, activation checkpointing, offload of the
    unit's state and of its activations), so what was predicted is what runs. ``wrap``,
    ``strategy`` and ``cpu_offload`` then come from the plan and must not be passed as well.

    init_from: a standard safetensors model (a ``model.safetensors`` file, a Hugging Face
    index, or a directory holding either) whose values replace the initial ones, each rank
    reading only its rows (``shardwise.load_full``). fault_tolerance: ``shardwise.ft.Torchft``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"shard() takes an nn.Module, got {type(module).__name__}")
    settings = _settings(plan, wrap=wrap, strategy=strategy, cpu_offload=cpu_offload)
    if settings is not None:
        wrap, strategy = settings.wrap, settings.strategy
    sharding = Sharding.of(strategy or Sharding.FULL_SHARD)
    if max_unsharded < 1:
        raise ShardwiseError(f"max_unsharded={max_unsharded} must be at least 1")
    _refuse_sharded(module)
    rt = build(
        module, wrap=wrap, sharding=sharding, settings=settings,
        group=group, mesh=mesh, shard_size=shard_size, init=init,
        precision=MixedPrecision.of(mixed_precision), cpu_offload=cpu_offload,
        max_unsharded=max_unsharded, placement=placement, comm=Comm.of(comm), replica_groups=_replica_groups(fault_tolerance),
    )
    optimizer_guard.watch(rt)
    if init_from is not None:
        load_full(module, init_from)
    return module


def _replica_groups(fault_tolerance):
    """``shard(fault_tolerance=...)``, checked: replica groups outside the job, or None."""
    if fault_tolerance is not None and not isinstance(fault_tolerance, ReplicaGroups):
        raise ShardwiseError(
            f"fault_tolerance={type(fault_tolerance).__name__} is not replica groups: pass a "
            "shardwise.ft.Torchft(lighthouse=..., replica_id=...) (or an object with attach, "
            "all_reduce and size: shardwise.core.replica_groups.ReplicaGroups)"
        )
    return fault_tolerance


def _refuse_sharded(module: nn.Module) -> None:
    for name, m in module.named_modules():
        if getattr(m, "_shardwise", None) is not None:
            where = f"its submodule '{name}'" if name else "it"
            raise ShardwiseError(
                f"{type(module).__name__} is already sharded ({where} was passed to "
                "shard() before); shard() runs once per model: build a new model to shard again."
            )


def _settings(plan, *, wrap, strategy, cpu_offload) -> Settings | None:
    """The plan's settings, refusing arguments that would contradict them."""
    if plan is None:
        return None
    settings = getattr(plan, "settings", plan)  # a planner.plan.Plan carries its choice's
    if not isinstance(settings, Settings):
        raise TypeError(
            f"shard(plan=...) takes shardwise.plan()'s result or a policies.Settings, got "
            f"{type(plan).__name__}"
        )
    given = {"wrap": wrap, "strategy": strategy, "cpu_offload": cpu_offload or None}
    clash = [f"{k}={v!r}" for k, v in given.items() if v is not None and v != getattr(settings, k, None)]
    if clash:
        raise ShardwiseError(
            f"shard(plan=...) applies the plan's wrap, strategy ('{settings.strategy}') and "
            f"per-unit settings, but {', '.join(clash)} was passed too: drop it, or plan again "
            "with it (shardwise.plan(..., wrap=..., strategy=...))"
        )
    return settings


# --- gradient accumulation and clipping
@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes inside accumulate full gradients locally, with no communication; the
    next backward outside reduces the accumulated gradients (costs one unit of full gradient
    memory per unit, as in DDP's and FSDP's no_sync)."""
    rt = runtime_of(model)
    prev, rt.sync_grads = rt.sync_grads, False
    try:
        yield
    finally:
        rt.sync_grads = prev


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of a sharded model by their global norm, and return that norm.

    Each rank reduces its shards' gradients to one number and one all-reduce combines them, so
    the result equals ``torch.nn.utils.clip_grad_norm_`` on the unsharded model (each shared
    parameter counted once).
    """
    rt = runtime_of(model)
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    device = groups.device()
    norm_type = float(norm_type)
    if grads:
        local = torch.nn.utils.get_total_norm(grads, norm_type).to(device, torch.float32)
    else:
        local = torch.zeros((), device=device)
    sharded = any(isinstance(u, ShardedUnit) for u in rt.units)
    if sharded and dist.get_world_size(rt.units[0].group) > 1:
        group = rt.units[0].group
        if math.isinf(norm_type):
            C.all_reduce(local, group, "clip_grad_norm", op=dist.ReduceOp.MAX).wait()
            total = local
        else:
            powered = local.pow(norm_type)
            C.all_reduce(powered, group, "clip_grad_norm").wait()
            total = powered.pow(1.0 / norm_type)
    else:
        total = local
    if params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


# --- whole parameters: state dicts, inspection, other methods than forward
def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded state dict as CPU tensors under the original names (every rank must call
    it; with ``rank0_only`` the other ranks get ``{}``), loadable with ``load_state_dict`` into
    the unsharded module. With hybrid sharding and ``rank0_only`` only rank 0's shard group
    gathers."""
    rt = runtime_of(model)
    require_idle(rt, "full_state_dict")
    one_replica = rank0_only and rt.mesh.replicate is not None
    if one_replica and not rt.mesh.in_first_shard_group():
        return {}
    keep = not rank0_only or dist.get_rank() == 0
    values: dict[str, torch.Tensor] = {}
    with flight.apart() if one_replica else contextlib.nullcontext():
        for unit in rt.units:
            full = unit.gather_full()
            if keep:
                for r in unit.registrations:
                    values[r.fqn] = full[r.index].detach().to("cpu", copy=True)
    if not keep:
        return {}
    out = {}
    for k, v in model.state_dict(keep_vars=True).items():
        out[k] = values[k] if k in values else v.detach().to("cpu", copy=True)
    return out


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor] | None) -> None:
    """Scatter a full state dict into the shards. Rank 0's dict is used (other ranks may pass
    None); keys and shapes are checked on rank 0 and a mismatch raises on every rank."""
    rt = runtime_of(model)
    require_idle(rt, "load_full_state_dict")
    expected = model.state_dict(keep_vars=True)
    full_shapes = {r.fqn: u.full_params[r.index].shape for u in rt.units for r in u.registrations}
    problem = ""
    if dist.get_rank() == 0:
        problem = _state_dict_problem(state_dict, expected, full_shapes)
    C.agree(problem, "load_full_state_dict check", ShardwiseError)
    device = groups.device()
    with torch.no_grad():
        for unit in rt.units:
            firsts = {}
            for r in unit.registrations:
                firsts.setdefault(r.index, r.fqn)
            shapes = [unit.full_params[i].shape for i in range(len(firsts))]
            src = (
                [state_dict[firsts[i]] for i in range(len(firsts))]
                if dist.get_rank() == 0
                else [torch.empty(s, dtype=unit.full_params[0].dtype) for s in shapes]
            )
            if src:
                values = [t.to(unit.full_params[0].dtype) for t in src]
                unit.load_full(broadcast_from_rank0(values, device, rt.mesh.whole, unit.label))
        for name, b in model.named_buffers():
            if name in expected:
                src = state_dict[name] if dist.get_rank() == 0 else b
                b.copy_(broadcast_from_rank0([src.to(b.dtype)], device, rt.mesh.whole, name)[0])


def _state_dict_problem(sd, expected, full_shapes) -> str:
    if sd is None:
        return "load_full_state_dict got None on rank 0; rank 0 must pass the full state dict"
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    if missing or unexpected:
        return f"state dict does not match the model: missing keys {missing}, unexpected keys {unexpected}"
    for k, shape in full_shapes.items():
        if tuple(sd[k].shape) != tuple(shape):
            return f"state dict entry '{k}' has shape {tuple(sd[k].shape)}, the model needs {tuple(shape)}"
    return ""


def reset(model: nn.Module) -> None:
    """Discard the step in progress: wait for its collectives in flight, drop the gradients
    not yet on the shards (those accumulated under ``no_sync`` included) and reshard every
    unit, as shardwise does by itself at the next step after a forward or a backward that
    raised (docs/architecture.md, "A step that raised").

    Needed only where shardwise cannot tell that a step was given up: a loss that raised
    outside the model (or a backward skipped on purpose) in the middle of a ``no_sync``
    accumulation, with a sharded strategy or mixed precision; call it on every rank, with
    ``optimizer.zero_grad()``, before the next step. The forward that completed cannot be
    told from one whose backward comes later (two forwards, one loss).
    """
    rt = runtime_of(model)
    if rt.callback_queued and not rt.step_abandoned():  # a backward is running
        raise ShardwiseError("reset() was called during backward; call it between steps")
    rt.reset()


@contextlib.contextmanager
def gathered(model: nn.Module, *, writeback: bool = False) -> Iterator[nn.Module]:
    """Inside, every module of ``model`` holds its full parameters (for inspection, generation
    helpers or edits); with ``writeback`` edits made inside are kept in the shards."""
    rt = runtime_of(model)
    require_idle(rt, "gathered")
    for u in rt.units:
        u.wait_unshard()
    try:
        yield model
    finally:
        for u in rt.units:
            if writeback and isinstance(u, ShardedUnit):
                u.load_full([p.detach() for p in u.full_params])
            u.reshard()


def register_forward_method(module: nn.Module, name: str) -> None:
    """Make calls of ``module.<name>()`` gather and free the unit like ``forward`` does (for
    methods such as ``generate`` or ``encode`` that use the parameters directly).

    The call goes through the module's own hooks: ``module(...)`` runs with the method in
    place of ``forward`` for that one call, and the real ``forward`` is back before the method
    starts, so the method's own calls of the model (``generate`` calls ``forward`` per token)
    are ordinary forwards. The replacement keeps the method's name, docstring and signature
    (``functools.wraps``), which libraries such as transformers inspect.
    """
    method = getattr(module, name)

    @functools.wraps(method)
    def call_with_hooks(*args, **kwargs):
        own = module.__dict__.get("forward")

        def restore() -> None:
            if own is not None:
                module.forward = own
            else:
                module.__dict__.pop("forward", None)

        def run(*a, **k):
            restore()
            return method(*a, **k)

        module.forward = run
        try:
            return module(*args, **kwargs)
        finally:
            restore()

    setattr(module, name, call_with_hooks)


def unit_states(model: nn.Module) -> dict[str, str]:
    """Each unit's life-cycle state on this rank ('SHARDED', 'GATHERING', 'UNSHARDED')."""
    return {u.label: u.state.name for u in runtime_of(model).units}


def units(model: nn.Module) -> list[Unit]:
    """The units of a sharded model, innermost first and the root last (read-only use)."""
    return list(runtime_of(model).units)


