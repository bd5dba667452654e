"""How ``shard()`` turns a module tree into units and their runtime (``build``): pick units with
the wrap policy, give each parameter to the innermost unit that holds every module using it,
lay each unit out over the ranks (placement chooses owners), fill each rank's shards from rank
0's values (eager modules) or by initialising one module at a time (meta modules), then make
the units, the runtime that drives them, and the recomputation and activation offload a plan
asks for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from . import collectives as C
from . import groups, optimizer_guard, streams
from . import placement as placements
from .activation_offload import offload_activations
from .conversions import guard_conversions
from .errors import ShardwiseError
from .groups import Mesh
from .layout import Layout, Slot
from .policies import Comm, MixedPrecision, Recompute, Settings, Sharding, UnitConfig
from .recompute import checkpoint_activations
from .replica_groups import ReplicaGroups
from .runtime import Runtime
from .streams import Streams
from .unit import Registration, ReplicatedUnit, ShardedUnit, Unit, shard_param
from .wrap import CONTAINERS, Policy


@dataclass
class UnitPlan:
    """A unit before it exists: its module, name and the parameters it will own."""

    module: nn.Module
    name: str
    params: list[nn.Parameter] = field(default_factory=list)
    registrations: list[Registration] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.name or "<root>"

    @property
    def is_root(self) -> bool:
        return self.name == ""


def select_units(root: nn.Module, policy: Policy | None) -> list[UnitPlan]:
    """Units chosen by ``policy``, innermost first, with the root last."""
    chosen = []
    if policy is not None:
        for name, module in root.named_modules():
            if not name:
                continue
            picked = policy(module, name)
            if not isinstance(picked, bool):
                raise ShardwiseError(
                    f"wrap policy {policy!r} returned {picked!r} for '{name}'; a policy must "
                    "return True or False"
                )
            if picked and isinstance(module, CONTAINERS):
                raise ShardwiseError(
                    f"wrap policy {policy!r} selected '{name}', a {type(module).__name__}: a "
                    "container is never called, so its parameters could never be gathered. "
                    "Select the modules inside it instead (e.g. shardwise.wrap.by_class(Block))."
                )
            if picked:
                chosen.append(UnitPlan(module, name))
    chosen.sort(key=lambda u: -u.name.count("."))  # innermost first
    return chosen + [UnitPlan(root, "")]


def assign_params(root: nn.Module, plans: list[UnitPlan]) -> None:
    """Give every parameter to the innermost unit that contains all modules using it."""
    unit_names = {p.name for p in plans}
    by_name = {p.name: p for p in plans}

    def unit_chain(module_name: str) -> list[str]:
        parts = module_name.split(".") if module_name else []
        chain = [""]
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in unit_names:
                chain.append(prefix)
        return chain

    users: dict[nn.Parameter, list[tuple[nn.Module, str, str]]] = {}
    for mname, module in root.named_modules():
        for attr, p in module._parameters.items():
            if p is not None:
                users.setdefault(p, []).append((module, attr, mname))
    for p, places in users.items():
        chains = [unit_chain(mname) for _, _, mname in places]
        common = chains[0]
        for c in chains[1:]:
            n = 0
            while n < min(len(common), len(c)) and common[n] == c[n]:
                n += 1
            common = common[:n]
        plan = by_name[common[-1]]
        index = len(plan.params)
        plan.params.append(p)
        for module, attr, mname in places:
            fqn = f"{mname}.{attr}" if mname else attr
            plan.registrations.append(Registration(module, attr, index, fqn))


def check_plans(root: nn.Module, plans: list[UnitPlan]) -> torch.device | None:
    """Refuse what cannot be sharded; return the one device of the non-meta parameters."""
    seen: dict[torch.device, str] = {}
    for plan in plans:
        dtypes = {}
        for p, r in first_names(plan):
            dtypes.setdefault(p.dtype, r.fqn)
            if not p.is_meta:
                seen.setdefault(p.device, r.fqn)
        if len(dtypes) > 1:
            names = ", ".join(f"'{n}' ({d})" for d, n in dtypes.items())
            raise ShardwiseError(
                f"unit '{plan.label}' mixes parameter dtypes: {names}; one unit is one flat "
                "buffer of one dtype. Cast the module to one dtype before shard() (e.g. "
                "module.float()), or wrap the parts of other dtypes as units of their own."
            )
    if len(seen) > 1:
        names = ", ".join(f"'{n}' on {d}" for d, n in seen.items())
        raise ShardwiseError(
            f"parameters are on different devices: {names}. Move the module to one device "
            "first (module.to(device)), or build it on the meta device."
        )
    return next(iter(seen), None)


def first_names(plan: UnitPlan):
    firsts = {}
    for r in plan.registrations:
        firsts.setdefault(r.index, r)
    return [(p, firsts[i]) for i, p in enumerate(plan.params)]


def layout_of(plan: UnitPlan, world_size: int, owners: list[int | None] | None = None) -> Layout:
    return Layout.build([(r.fqn, tuple(p.shape)) for p, r in first_names(plan)], world_size, owners)


def fill_slot(flat_shard: torch.Tensor, slot: Slot, rank: int, full: torch.Tensor) -> None:
    """Copy this rank's rows of the full tensor ``full`` into its segment of ``flat_shard``."""
    start, stop = slot.row_range(rank)
    n, at = (stop - start) * slot.row_numel, slot.offsets[rank]
    flat_shard[at : at + n].copy_(full.reshape(slot.rows, -1)[start:stop].reshape(-1))


def broadcast_from_rank0(tensors: list[torch.Tensor], device: torch.device, group, label: str) -> list[torch.Tensor]:
    """Rank 0's values of ``tensors`` on every rank, in one collective."""
    flat = torch.cat([t.detach().reshape(-1).to(device) for t in tensors])
    C.broadcast(flat, 0, group, label).wait()
    return [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def materialize(
    root: nn.Module,
    device: torch.device,
    init_fn: Callable[[nn.Module], None] | None,
    on_values: Callable[[list[nn.Parameter], list[torch.Tensor]], None],
    group,
) -> None:
    """Initialise meta parameters one module at a time, in module order.

    Each module's own meta parameters get temporary full storage, ``init_fn(module)`` fills
    them (by default the root's ``_init_weights(module)`` when it is a transformers model, as
    its ``from_config`` initialises every module, else the module's ``reset_parameters()``),
    rank 0's values are broadcast and handed to ``on_values`` (which keeps this rank's rows),
    and the storage is dropped: at most one module is ever whole. A parameter shared with a
    module initialised earlier is swapped for scratch storage, as eager construction discards
    a tied module's own weight, so random streams match eager construction with the same seed.
    Meta buffers are materialised in place. Raises, naming them, if parameters or buffers are
    left uninitialised.
    """
    done: set[nn.Parameter] = set()
    missing: list[str] = []
    # a transformers model's own initialiser (its PreTrainedModel has a base_model_prefix)
    transformers = hasattr(root, "base_model_prefix")
    model_init = getattr(root, "_init_weights", None) if transformers else None
    for mname, module in root.named_modules():
        own = [(a, p) for a, p in module._parameters.items() if p is not None and p.is_meta]
        bufs = [(a, b) for a, b in module._buffers.items() if b is not None and b.is_meta]
        if not own and not bufs:
            continue
        if init_fn is not None or model_init is not None:
            init = functools.partial(init_fn or model_init, module)
        else:
            init = getattr(module, "reset_parameters", None)
        if init is None:
            missing += [f"{mname}.{a}" if mname else a for a, p in own if p not in done]
            missing += [f"{mname}.{a}" if mname else a for a, _ in bufs]
            continue
        temps = {a: nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad) for a, p in own}
        for a, b in bufs:
            module._buffers[a] = torch.empty_like(b, device=device)
        for a, t in temps.items():
            module._parameters[a] = t
        try:
            with torch.no_grad():
                init()
        finally:
            for a, p in own:
                module._parameters[a] = p
        fresh = [(p, temps[a]) for a, p in own if p not in done]
        if fresh:
            values = broadcast_from_rank0([t for _, t in fresh], device, group, mname or "<root>")
            on_values([p for p, _ in fresh], values)
            done.update(p for p, _ in fresh)
        if bufs:
            values = broadcast_from_rank0([module._buffers[a] for a, _ in bufs], device, group, mname or "<root>")
            for (a, _), v in zip(bufs, values):
                module._buffers[a] = v.clone()
    if missing:
        raise ShardwiseError(
            f"no initialiser for meta-device tensors {missing}: their modules have no "
            "reset_parameters(). Give those modules a reset_parameters() method, or pass "
            "shard(..., init=fn) where fn(module) initialises a module's own parameters."
        )


# --- from UnitPlans to units and their runtime
def build(
    module: nn.Module,
    *,
    wrap: Policy | None,
    sharding: Sharding,
    settings: Settings | None,
    group: dist.ProcessGroup | None,
    mesh: DeviceMesh | None,
    shard_size: int | None,
    init: Callable[[nn.Module], None] | None,
    precision: MixedPrecision,
    cpu_offload: bool,
    max_unsharded: int,
    placement: placements.Placement | None,
    comm: Comm,
    replica_groups: ReplicaGroups | None = None,
) -> Runtime:
    """Shard ``module`` in place as ``shard()`` describes, and attach its ``Runtime``."""
    plans = select_units(module, wrap)
    configs = _unit_configs(plans, settings, sharding, cpu_offload)
    groups.rank_and_size(None)  # a process group exists
    layout_mesh = groups.mesh_of(group, mesh, hybrid=sharding.hybrid, shard_size=shard_size)
    # no_shard: every rank holds every parameter whole (a layout of one rank); owned ones are
    # only marked
    rank, world = groups.rank_and_size(layout_mesh.shard) if sharding.shard else (0, 1)
    assign_params(module, plans)
    param_device = check_plans(module, plans)
    device = groups.device() if param_device is None or param_device.type == "cpu" else param_device
    owners = placements.choose_owners(_owned(plans, placement), world)
    layouts = [layout_of(p, world, o) for p, o in zip(plans, owners)]
    flats = _fill_shards(module, plans, layouts, configs, rank, device, init, precision, layout_mesh.whole)
    side_streams = streams.for_device(device)
    units = [
        _unit(up, lay, flat, config, layout_mesh, sharding, device, precision, comm, side_streams, replica_groups)
        for up, lay, flat, config in zip(plans, layouts, flats, configs)
    ]
    module._shardwise = rt = Runtime(
        module, units, sharding, layout_mesh, max_unsharded, precision,
        groups.host_group(layout_mesh.whole), comm, replica_groups,
    )
    guard_conversions(module, rt)  # Note [conversions after shard()]
    for kind in (Recompute.FULL, Recompute.SELECTIVE):
        recomputed = {p.name for p, c in zip(plans, configs) if c.checkpoint is kind}
        if recomputed:
            checkpoint_activations(module, lambda m, name, r=recomputed: name in r, selective=kind is Recompute.SELECTIVE)
    offloaded = [p.name for p, c in zip(plans, configs) if c.offload_activations]
    if offloaded:
        rt.activations = offload_activations(module, offloaded, [p.name for p in plans], device)
    if replica_groups is not None:
        replica_groups.attach(module)  # (replica groups outside the job: healing reads the runtime)
    return rt


def _unit_configs(
    plans: list[UnitPlan], settings: Settings | None, sharding: Sharding, cpu_offload: bool
) -> list[UnitConfig]:
    """Each unit's settings: the plan's, or the strategy's for every unit. A plan names
    exactly the units the wrap policy makes; the root recomputes nothing."""
    if settings is None:
        configs = [UnitConfig(sharding.reshard_after_forward, Recompute.NONE, cpu_offload) for _ in plans]
    else:
        configs = [settings.of(p.name) for p in plans]
        extra = {n for n, _ in settings.units} - {p.name for p in plans}
        if extra:
            raise ShardwiseError(
                f"the plan has settings for {sorted(n or '<root>' for n in extra)}, which this "
                "model's wrap policy does not make units: plan the model you shard"
            )
    for p, c in zip(plans, configs):
        if p.is_root and c.checkpoint is not Recompute.NONE:
            raise ShardwiseError(
                f"UnitConfig(checkpoint={c.checkpoint.value!r}) on the root unit would recompute the whole "
                "model: checkpoint wrapped units instead"
            )
    if any(c.offload for c in configs) and not sharding.shard:
        raise ShardwiseError(
            "cpu_offload=True needs a sharded strategy: with no_shard every rank keeps whole "
            "parameters on the device anyway. Use strategy='full_shard' or 'shard_grad_op'."
        )
    return configs


def _owned(plans: list[UnitPlan], placement: placements.Placement | None) -> list[list[tuple[int, bool]]]:
    """(numel, owned) of each unit's parameters under ``placement``; the root unit's are rows."""
    return [
        [
            (p.numel(), placement is not None and not plan.is_root and placements.ask(placement, r.fqn, p))
            for p, r in first_names(plan)
        ]
        for plan in plans
    ]


def _fill_shards(
    module: nn.Module,
    plans: list[UnitPlan],
    layouts: list[Layout],
    configs: list[UnitConfig],
    rank: int,
    device: torch.device,
    init: Callable[[nn.Module], None] | None,
    precision: MixedPrecision,
    whole,
) -> list[torch.Tensor]:
    """Each unit's flat shard (where the master shards live: host memory for an offloaded
    unit), filled with this rank's rows of rank 0's values; buffers broadcast and cast."""
    flats = [
        torch.zeros(
            lay.sizes[rank],
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
            fill_slot(flats[ui], layouts[ui].slots[si], rank, v)

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
    return flats


def _unit(
    up: UnitPlan,
    lay: Layout,
    flat: torch.Tensor,
    config: UnitConfig,
    mesh: Mesh,
    sharding: Sharding,
    device: torch.device,
    precision: MixedPrecision,
    comm: Comm,
    side_streams: Streams | None,
    replica_groups: ReplicaGroups | None,
) -> Unit:
    """One unit over its filled flat shard; the parameters it replaces are retired."""
    rg = [p.requires_grad for p in up.params]
    if sharding.shard:
        unit = ShardedUnit(
            up.module, up.name, up.registrations, mesh.shard, lay, flat, rg,
            device=device, precision=precision, offload=config.offload, streams=side_streams,
            replicate=mesh.replicate, comm=comm, replica_groups=replica_groups,
            reshard_after_forward=config.reshard_after_forward and not up.is_root,
        )
    else:
        params = [shard_param(v, r, slot, 1) for v, r, slot in zip(lay.unsharded_views(flat), rg, lay.slots)]
        for r in up.registrations:
            r.module._parameters[r.attr] = params[r.index]
        unit = ReplicatedUnit(
            up.module, up.name, up.registrations, mesh.shard, params, precision=precision, comm=comm, replica_groups=replica_groups
        )
    for r in up.registrations:
        optimizer_guard.retire(up.params[r.index], r.fqn)
    return unit
