"""Bytes each rank holds (parameter shards, gradients, optimizer state) against what DDP would
hold, and the bytes a step should communicate in theory."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..api import units
from ..core.codecs import Codec
from ..core.collectives import step_check_nbytes
from ..core.policies import Sharding
from ..core.runtime import runtime_of
from ..core.unit import ReplicatedUnit, ShardedUnit


def _full_numel(model: nn.Module) -> dict[nn.Parameter, int]:
    """For every parameter the optimizer sees (shard or whole), its unsharded element count."""
    out = {}
    for u in units(model):
        if isinstance(u, ShardedUnit):
            for p, s in zip(u.shard_params, u.layout.slots):
                out[p] = s.numel
        else:
            for p in u.params:
                out[p] = p.numel()
    return out


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """What this rank holds now, and what one DDP rank would hold for the same model.

    params: the flat shards (padding included) or whole parameters; grads: the ``.grad`` tensors
    present now (call after backward); optimizer: every tensor in the optimizer's state.
    """
    full = _full_numel(model)
    shards = [[u.flat_shard] if isinstance(u, ShardedUnit) else u.params for u in units(model)]
    params = sum(p.nbytes for ps in shards for p in ps)
    grads = sum(p.grad.nbytes for p in full if p.grad is not None)
    opt_bytes = ddp_opt = 0
    if optimizer is not None:
        for p, st in optimizer.state.items():
            for t in st.values():
                if isinstance(t, torch.Tensor):
                    opt_bytes += t.nbytes
                    scale = full.get(p, p.numel()) if t.shape == p.shape else t.numel()
                    ddp_opt += scale * t.element_size()
    ddp_params = sum(n * p.element_size() for p, n in full.items())
    ddp_grads = sum(n * p.element_size() for p, n in full.items() if p.requires_grad)
    return dict(
        params=params, grads=grads, optimizer=opt_bytes,
        ddp_params=ddp_params, ddp_grads=ddp_grads, ddp_optimizer=ddp_opt,
    )


def kept_buckets(model: nn.Module) -> list[torch.Tensor]:
    """The flat gradient buckets no_shard units keep from step to step (their gradients are
    views of them). A memory tool that follows parameters, gradients and optimizer state does
    not see them while the gradients are None between steps: hand them to it as well."""
    kept = [u._flat_grad for u in units(model) if isinstance(u, ReplicatedUnit)]
    return [b for b in kept if b is not None]


def _wire(codec: Codec | None, itemsize: int, psi: int) -> float:
    """Bytes per element sent: the dtype's, or an encoding's (blocks of the whole, scales included)."""
    return itemsize if codec is None else round(codec.nbytes(psi) / max(psi, 1), 4)


def theory(
    strategy: Sharding | str, psi: int, *, world: int, replicate: int = 1, b_gather: float, b_reduce: float,
    b_across: float | None = None, root: int = 0, trained: int | None = None,
) -> dict[str, float]:
    """Bytes per rank per step by collective kind in theory, for psi parameters on ``world``
    = R x S ranks (R = ``replicate`` shard groups of S with hybrid sharding, else S = N) and
    ring collectives sending b bytes per element: full shard gathers every unit twice, less
    the ``root`` unit's parameters' backward gather (it stays gathered from forward to
    backward), and reduce-scatters once, 3 psi b (S-1)/S; shard_grad_op gathers once; no_shard
    (DDP) all-reduces, 2 psi b (N-1)/N. Hybrid sharding all-reduces each rank's reduced shard
    across the replicas, 2 psi b_across (R-1)/(R S). With ``trained`` (parameters that train),
    the step check: one all-reduce over all N of a flag per trained parameter and two numbers."""
    sharding = Sharding.of(strategy)
    r = replicate if sharding.hybrid else 1
    s = world // r
    out = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    if sharding.shard:
        gathered = 2 * psi - root if sharding.reshard_after_forward else psi
        out["all_gather"] = gathered * b_gather * (s - 1) // s
        out["reduce_scatter"] = psi * b_reduce * (s - 1) // s
    else:
        out["all_reduce"] = 2 * psi * b_reduce * (world - 1) // world
    if sharding.hybrid:
        out["replicate_all_reduce"] = 2 * psi * (b_across or b_reduce) * (r - 1) // (r * s)
    if trained is not None:
        out["step_check"] = 2 * step_check_nbytes(trained) * (world - 1) // world
    return out


def formula(strategy: Sharding | str, same_b: bool = True) -> str:
    """``theory``'s formula, with one b, or b_gather and b_reduce."""
    sharding = Sharding.of(strategy)
    if not sharding.shard:
        return "2*psi*b*(N-1)/N"
    g = "S" if sharding.hybrid else "N"
    gathers = 2 if sharding.reshard_after_forward else 1
    out = f"{gathers + 1}*psi*b" if same_b else f"({gathers}*b_gather + b_reduce)*psi"
    out += f"*({g}-1)/{g}"
    if sharding.hybrid:
        out += f" + 2*psi*{'b' if same_b else 'b_reduce'}*(R-1)/(R*S)"
    return out


_NOTES = {
    Sharding.FULL_SHARD: "measured is lower by the root unit's backward gather (it stays gathered "
    "from forward to backward) and higher by padding rows",
    Sharding.SHARD_GRAD_OP: "one gather in forward, one reduce-scatter; padding rows add a little",
    Sharding.NO_SHARD: "DDP's all-reduce; the gradient-norm all-reduce adds 4 bytes",
    Sharding.HYBRID_SHARD_GRAD_OP: "one gather in forward and one reduce-scatter in the shard "
    "group, then the replicate all-reduce of each rank's reduced shard; padding rows add a little",
}
_NOTES[Sharding.HYBRID_SHARD] = _NOTES[Sharding.FULL_SHARD] + (
    "; the replicate all-reduce moves each rank's reduced shard across the replicas"
)


def theory_bytes_per_step(model: nn.Module, strategy: Sharding | str) -> dict:
    """``theory`` for a sharded model (its world, mesh and wire precision), without the step
    check, split by link: ``within`` the shard group, ``across`` the replicas. With ``comm``
    the encoded collectives' b is the codec's bytes per element, scales included."""
    psi = sum(_full_numel(model).values())
    u, runtime = units(model)[0], runtime_of(model)
    s = dist.get_world_size(u.group)
    r = dist.get_world_size(runtime.mesh.replicate) if runtime.mesh.replicate is not None else 1
    comm = runtime.comm
    b_gather = _wire(comm.gather_codec, u.compute_dtype.itemsize, psi)
    b_reduce = _wire(comm.reduce_codec, u.reduce_dtype.itemsize, psi)
    b_across = _wire(comm.replicate_codec, u.reduce_dtype.itemsize, psi)
    strategy = Sharding.of(strategy)
    kept = _kept_gathered(model) if strategy.reshard_after_forward else 0
    kinds = theory(
        strategy, psi, world=r * s, replicate=r, b_gather=b_gather, b_reduce=b_reduce, b_across=b_across,
        root=kept,
    )
    across = int(kinds.pop("replicate_all_reduce", 0))
    within = int(sum(kinds.values()))
    same = b_gather == b_reduce or not strategy.shard
    return {
        "formula": formula(strategy, same),
        "bytes": within + across,
        "within": within,
        "across": across,
        "replicate": r,
        "shard": s,
        "psi": psi,
        "b": b_reduce if same else f"{b_gather} (gather), {b_reduce} (reduce)",
        "note": _NOTES[strategy] + ("; blocks a plan keeps gathered after forward are gathered once" if kept else ""),
    }


def _kept_gathered(model: nn.Module) -> int:
    """Parameters of the units other than the root that a plan keeps gathered from forward to
    backward (``UnitConfig.reshard_after_forward``): gathered once a step, not twice."""
    return sum(
        slot.numel
        for u in units(model)
        if isinstance(u, ShardedUnit) and not u.is_root and not u.reshard_after_forward
        for slot in u.layout.slots
    )


def dtype_table(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, show: bool = True) -> list[dict]:
    """Per unit: the dtype of storage (shards), compute (gathered), communication (the gather
    as it goes on the wire), reduction (gradients: the dtype they are reduced in, or their
    wire format when ``comm`` encodes them; hybrid's all-reduce across replicas after a ``/``
    where it differs) and optimizer state. Printed when ``show``; returned as rows."""
    rows = []
    for u in units(model):
        storage = u.flat_shard.dtype if isinstance(u, ShardedUnit) else (u.params[0].dtype if u.params else None)
        params = u.shard_params if isinstance(u, ShardedUnit) else u.params
        state = {
            t.dtype for p in params if optimizer is not None for t in optimizer.state.get(p, {}).values()
            if isinstance(t, torch.Tensor) and t.numel() > 1
        }
        rows.append({
            "unit": u.label,
            "storage": _short(storage),
            "compute": _short(u.compute_dtype),
            "communication": _on_wire(u.gather_codec, u.compute_dtype) if isinstance(u, ShardedUnit) else "-",
            "reduction": _reduction(u),
            "optimizer_state": ",".join(sorted(_short(d) for d in state)) or _short(storage),
        })
    if show and rows:
        cols = list(rows[0])
        widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
        print("  ".join(c.ljust(widths[c]) for c in cols))
        for r in rows:
            print("  ".join(str(r[c]).ljust(widths[c]) for c in cols))
    return rows


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """A dtype as tools show it ("float32"); None stays None."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _short(dtype: torch.dtype | None) -> str:
    return dtype_name(dtype) or "-"


def _on_wire(codec: Codec | None, dtype: torch.dtype) -> str:
    return codec.name if codec is not None else _short(dtype)


def _reduction(u: ReplicatedUnit | ShardedUnit) -> str:
    within = _on_wire(u.reduce_codec, u.reduce_dtype)
    if not isinstance(u, ShardedUnit) or u.replicate_size == 1:
        return within
    across = _on_wire(u.replicate_codec, u.reduce_dtype)
    return within if across == within else f"{within} / {across}"
