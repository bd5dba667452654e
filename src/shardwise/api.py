"""The public functions: shard a model, accumulate without sync, clip, full state dicts."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import collectives as C
from . import flight, groups, streams
from . import placement as placements
from .activation_offload import offload_activations
from .conversions import guard_conversions
from .build import (
    UnitPlan,
    assign_params,
    broadcast_from_rank0,
    check_plans,
    fill_slot,
    first_names,
    layout_of,
    materialize,
    select_units,
)
from .recompute import checkpoint_activations
from .errors import ShardwiseError
from .policies import Comm, MixedPrecision, Settings, Sharding, UnitConfig
from .runtime import Phase, Runtime, require_idle, runtime_of
from .unit import ReplicatedUnit, ShardedUnit, Unit, shard_param
from .wrap import Policy

Strategy = Literal["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_grad_op"]


def shard(
    module: nn.Module,
    *,
    wrap: Policy | None = None,
    strategy: Strategy | None = None,
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
    how many units (besides the root) full_shard keeps gathered at once, prefetch included.

    mixed_precision: "bf16" / "fp16" (16-bit gather and compute, fp32 gradient reduction) or a
    ``MixedPrecision``; shards and optimizer state stay in the parameters' dtype. fp16 needs a
    ``shardwise.GradScaler``. cpu_offload: shards, their gradients and so the optimizer state
    live in host memory; each unit is copied to the device just before its gather.

    placement: ``callable(name, param) -> "rows" | "owned"`` for the parameters of wrapped
    units (default: all rows). An owned parameter is held whole by one rank, which then holds
    its gradient and optimizer state whole too: optimizers that need whole matrices (Muon,
    Adafactor) are exact with ``shardwise.placement.matrices``. Owners are chosen largest
    first, each to the least-loaded rank of the shard group.

    comm: precision on the wire: "bf16", "fp8" (e4m3) or "int8" for every gather and
    reduction, or ``shardwise.Comm(gather=..., reduce=..., replica=..., error_feedback=...)``
    for each apart (``replica``: hybrid sharding's all-reduce across shard groups, the link
    between nodes). fp8 and int8 scale each block of 256 elements by its absolute maximum;
    sums are taken in fp32; master weights and optimizer state keep their dtype. Default:
    exact (the gather and reduction dtypes themselves).

    plan: what ``shardwise.plan(..., budget=...)`` chose (a ``Plan`` or its ``.settings``, a
    ``policies.Settings``): its wrap policy, strategy and per-unit settings are applied as
    they are (``UnitConfig``: reshard after forward, activation checkpointing, offload of
    the unit's state and of its activations), so
    what was predicted is what runs. ``wrap``, ``strategy`` and ``cpu_offload`` then come from
    the plan and must not be passed as well.

    init_from: a standard safetensors model (a ``model.safetensors`` file, a Hugging Face
    index, or a directory holding either) whose values replace the initial ones, each rank
    reading only its rows (``shardwise.load_full``).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"shard() takes an nn.Module, got {type(module).__name__}")
    settings = _settings(plan, wrap=wrap, strategy=strategy, cpu_offload=cpu_offload)
    if settings is not None:
        wrap, strategy = settings.wrap, settings.strategy
    sharding = Sharding.of(strategy or "full_shard")
    if max_unsharded < 1:
        raise ShardwiseError(f"max_unsharded={max_unsharded} must be at least 1")
    for name, m in module.named_modules():
        if getattr(m, "_shardwise", None) is not None:
            where = f"its submodule '{name}'" if name else "it"
            raise ShardwiseError(
                f"{type(module).__name__} is already sharded ({where} was passed to "
                "shard() before); shard() runs once per model: build a new model to shard again."
            )
    precision = MixedPrecision.of(mixed_precision)
    wire = Comm.of(comm)
    plans = select_units(module, wrap)
    configs = [
        settings.of(p.name) if settings else UnitConfig(sharding.reshard_after_forward, "none", cpu_offload)
        for p in plans
    ]
    _check_configs(plans, configs, settings)
    if any(c.offload for c in configs) and not sharding.shard:
        raise ShardwiseError(
            "cpu_offload=True needs a sharded strategy: with no_shard every rank keeps whole "
            "parameters on the device anyway. Use strategy='full_shard' or 'shard_grad_op'."
        )
    groups.rank_and_size(None)  # a process group exists
    layout_mesh = groups.mesh_of(group, mesh, hybrid=sharding.hybrid, shard_size=shard_size)
    group, whole = layout_mesh.shard, layout_mesh.whole
    rank, world = groups.rank_and_size(group)
    assign_params(module, plans)
    param_device = check_plans(module, plans)
    device = groups.device() if param_device is None or param_device.type == "cpu" else param_device

    sharded = sharding.shard
    owned = _owned(plans, placement)
    # no_shard: every rank holds every parameter whole; owned ones are only marked
    owners = placements.choose_owners(owned, world if sharded else 1)
    layouts = [layout_of(p, world if sharded else 1, o) for p, o in zip(plans, owners)]
    # where the master shards live: host memory for an offloaded unit
    flats = [
        torch.zeros(
            lay.sizes[rank if sharded else 0],
            dtype=p.params[0].dtype if p.params else torch.float32,
            device=torch.device("cpu") if c.offload else device,
            pin_memory=c.offload and device.type == "cuda",
        )
        for p, lay, c in zip(plans, layouts, configs)
    ]
    where = {}
    for ui, up in enumerate(plans):
        for si, p in enumerate(up.params):
            where[p] = (ui, si)

    def keep_rows(params: list[nn.Parameter], values: list[torch.Tensor]) -> None:
        for p, v in zip(params, values):
            ui, si = where[p]
            fill_slot(flats[ui], layouts[ui].slots[si], rank if sharded else 0, v)

    with torch.no_grad():
        if any(p.is_meta for up in plans for p in up.params) or any(b.is_meta for b in module.buffers()):
            materialize(module, device, init, keep_rows, whole)
        for up in plans:
            eager = [p for p in up.params if not p.is_meta]
            if eager:
                keep_rows(eager, broadcast_from_rank0(eager, device, whole, up.label))
        for name, b in module.named_buffers():
            if not b.is_meta:
                b.data = broadcast_from_rank0([b], device, whole, name)[0].clone()
            if precision.buffer_dtype is not None and b.is_floating_point():
                b.data = b.data.to(precision.buffer_dtype)

    side_streams = streams.for_device(device)
    units: list[Unit] = []
    for up, lay, flat, config in zip(plans, layouts, flats, configs):
        rg = [p.requires_grad for p in up.params]
        if sharded:
            units.append(
                ShardedUnit(
                    up.module, up.name, up.registrations, group, lay, flat, rg,
                    device=device, precision=precision, offload=config.offload, streams=side_streams,
                    replicate=layout_mesh.replicate, comm=wire,
                    reshard_after_forward=config.reshard_after_forward and not up.is_root,
                )
            )
        else:
            params = [
                shard_param(v, r, slot, 1) for v, r, slot in zip(lay.unsharded_views(flat), rg, lay.slots)
            ]
            for r in up.registrations:
                r.module._parameters[r.attr] = params[r.index]
            units.append(
                ReplicatedUnit(
                    up.module, up.name, up.registrations, group, params, precision=precision, comm=wire
                )
            )
        for r in up.registrations:
            _retire(up.params[r.index], r.fqn)
    module._shardwise = rt = Runtime(
        module, units, strategy or "full_shard", sharding, layout_mesh, max_unsharded, precision,
        groups.host_group(whole), wire,
    )
    shards = [p for u in units for p in (u.shard_params if isinstance(u, ShardedUnit) else u.params)]
    for p in shards:
        p._shardwise_runtime = weakref.ref(rt)  # Note [a step after a forward]
    guard_conversions(module, shards)  # Note [conversions after shard()]
    for kind in ("full", "selective"):
        recomputed = {p.name for p, c in zip(plans, configs) if c.checkpoint == kind}
        if recomputed:
            checkpoint_activations(module, lambda m, name, r=recomputed: name in r, selective=kind == "selective")
    offloaded = [p.name for p, c in zip(plans, configs) if c.offload_activations]
    if offloaded:
        rt.activations = offload_activations(module, offloaded, [p.name for p in plans], device)
    _install_optimizer_guard()
    if init_from is not None:
        from .checkpoint import load_full  # checkpoint builds on this module

        load_full(module, init_from)
    return module


def _settings(plan, *, wrap, strategy, cpu_offload) -> Settings | None:
    """The plan's settings, refusing arguments that would contradict them."""
    if plan is None:
        return None
    settings = getattr(plan, "settings", plan)  # a tools.plan.Plan carries its choice's
    if not isinstance(settings, Settings):
        raise TypeError(
            f"shard(plan=...) takes shardwise.plan()'s result or a policies.Settings, got "
            f"{type(plan).__name__}"
        )
    given = {"wrap": wrap, "strategy": strategy, "cpu_offload": cpu_offload or None}
    clash = [f"{k}={v!r}" for k, v in given.items() if v is not None and v != getattr(settings, k, None)]
    if clash:
        raise ShardwiseError(
            f"shard(plan=...) applies the plan's wrap, strategy ({settings.strategy!r}) and "
            f"per-unit settings, but {', '.join(clash)} was passed too: drop it, or plan again "
            "with it (shardwise.plan(..., wrap=..., strategy=...))"
        )
    return settings


def _check_configs(plans: list[UnitPlan], configs: list[UnitConfig], settings: Settings | None) -> None:
    """A plan names exactly the units the wrap policy makes; the root recomputes nothing."""
    if settings is not None:
        extra = {n for n, _ in settings.units} - {p.name for p in plans}
        if extra:
            raise ShardwiseError(
                f"the plan has settings for {sorted(n or '<root>' for n in extra)}, which this "
                "model's wrap policy does not make units: plan the model you shard"
            )
    for p, c in zip(plans, configs):
        if p.is_root and c.checkpoint != "none":
            raise ShardwiseError(
                f"UnitConfig(checkpoint={c.checkpoint!r}) on the root unit would recompute the whole "
                "model: checkpoint wrapped units instead"
            )


def _owned(plans: list[UnitPlan], placement: placements.Placement | None) -> list[list[tuple[int, bool]]]:
    """(numel, owned) of each unit's parameters under ``placement``; the root unit's are rows."""
    return [
        [
            (p.numel(), placement is not None and not plan.is_root and placements.ask(placement, r.fqn, p))
            for p, r in first_names(plan)
        ]
        for plan in plans
    ]


# --- the originals that shard() replaced, and the optimizers that still hold them
def _retire(p: nn.Parameter, fqn: str) -> None:
    if not hasattr(p, "_shardwise_retired"):
        p._shardwise_retired = fqn
        if not p.is_meta:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)


_checked_optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_guard_installed = False


def _install_optimizer_guard() -> None:
    global _guard_installed
    if not _guard_installed:
        register_optimizer_step_pre_hook(_check_optimizer)
        _guard_installed = True


# Note [a step after a forward]: a forward with gradients on leaves units gathered for the
# backward it expects (the root always; every unit under shard_grad_op). A loop that skips
# that backward (a loss that is NaN, a micro-batch it drops) and still steps the optimizer
# changes the shards under them, and the next forward, finding them gathered, would compute on
# the parameters from before the step, silently. So the optimizer's step first settles the
# runtimes of the parameters it steps when they are between a forward and a backward: their
# units reshard and gather again, from the new shards, when next called.
def _check_optimizer(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    key = tuple(len(g["params"]) for g in optimizer.param_groups)
    checked = _checked_optimizers.get(optimizer)
    if checked is None or checked[0] != key:
        checked = _checked_optimizers[optimizer] = (key, _check_params(optimizer))
    for ref in checked[1]:
        rt = ref()
        if rt is not None and rt.phase is Phase.FORWARD:
            rt.settle()


def _check_params(optimizer: torch.optim.Optimizer) -> list[weakref.ref]:
    """Refuse what the optimizer must not step; return the runtimes of its parameters."""
    runtimes = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            name = getattr(p, "_shardwise_retired", None)
            if name is not None:
                raise ShardwiseError(
                    f"{type(optimizer).__name__} steps parameter '{name}' as it was before "
                    "shardwise.shard(), which replaced it with this rank's shard: the optimizer "
                    "would update nothing. Build the optimizer after shard(), from "
                    "model.parameters()."
                )
            ref = getattr(p, "_shardwise_runtime", None)
            if ref is not None:
                runtimes[id(ref())] = ref
    placements.check_whole_matrices(optimizer)
    return list(runtimes.values())


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
    if one_replica and not rt.mesh.first_replica():
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
    msg = [problem]
    if dist.get_world_size() > 1:
        C.blocking("broadcast", "load_full_state_dict check", dist.broadcast_object_list, msg, src=0)
    if msg[0]:
        raise ShardwiseError(msg[0] if dist.get_rank() == 0 else f"rank 0 reported: {msg[0]}")
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


