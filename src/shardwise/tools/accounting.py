"""Bytes each rank holds (parameter shards, gradients, optimizer state) against what DDP would
hold, and the bytes a step should communicate in theory."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..api import units
from ..policies import Sharding
from ..quantize import Codec
from ..runtime import runtime_of
from ..unit import ReplicatedUnit, ShardedUnit


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
    params = 0
    for u in units(model):
        if isinstance(u, ShardedUnit):
            params += u.flat_shard.numel() * u.flat_shard.element_size()
        elif isinstance(u, ReplicatedUnit):
            params += sum(p.numel() * p.element_size() for p in u.params)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in full if p.grad is not None)
    opt_bytes = ddp_opt = 0
    if optimizer is not None:
        for p, st in optimizer.state.items():
            for t in st.values():
                if isinstance(t, torch.Tensor):
                    opt_bytes += t.numel() * t.element_size()
                    scale = full.get(p, p.numel()) if t.shape == p.shape else t.numel()
                    ddp_opt += scale * t.element_size()
    return {
        "params": params,
        "grads": grads,
        "optimizer": opt_bytes,
        "ddp_params": sum(n * p.element_size() for p, n in full.items()),
        "ddp_grads": sum(n * p.element_size() for p, n in full.items() if p.requires_grad),
        "ddp_optimizer": ddp_opt,
    }


def kept_buckets(model: nn.Module) -> list[torch.Tensor]:
    """The flat gradient buckets no_shard units keep from step to step (their gradients are
    views of them). A memory tool that follows parameters, gradients and optimizer state does
    not see them while the gradients are None between steps: hand them to it as well."""
    kept = [u._flat_grad for u in units(model) if isinstance(u, ReplicatedUnit)]
    return [b for b in kept if b is not None]


def _wire(fmt: str | None, itemsize: int, psi: int) -> float:
    """Bytes per element sent: the dtype's, or an encoding's (blocks of the whole, scales included)."""
    return itemsize if fmt is None else round(Codec(fmt).nbytes(psi) / max(psi, 1), 4)


def theory_bytes_per_step(model: nn.Module, strategy: str) -> dict:
    """Bytes per rank per step that the strategy moves in theory, for psi parameters on N ranks
    with b bytes per element sent: full shard 3 psi b (N-1)/N (two gathers, one
    reduce-scatter), shard_grad_op and DDP 2 psi b (N-1)/N. With mixed precision the gathers
    send b_gather and the reduction b_reduce bytes per element. Hybrid sharding on R replicas
    of S ranks: the same within the shard group, with S for N (``within``), and each rank's
    reduced shard all-reduced across the replicas, 2 psi b (R-1)/(R S) (``across``). With
    ``comm`` the encoded collectives' b is the codec's bytes per element, scales included."""
    full = _full_numel(model)
    psi = sum(full.values())
    us = units(model)
    mesh = runtime_of(model).mesh
    n = dist.get_world_size(us[0].group)
    r = dist.get_world_size(mesh.replicate) if mesh.replicate is not None else 1
    comm = runtime_of(model).comm
    b_gather = _wire(comm.gather, us[0].compute_dtype.itemsize, psi)
    b_reduce = _wire(comm.reduce, us[0].reduce_dtype.itemsize, psi)
    b_replica = _wire(comm.replica, us[0].reduce_dtype.itemsize, psi)
    sharding = Sharding.of(strategy)
    gathers = 2 if sharding.reshard_after_forward else 1 if sharding.shard else 0
    g = "S" if sharding.hybrid else "N"
    if not sharding.shard:
        total, formula = 2 * psi * b_reduce * (n - 1) // n, "2*psi*b*(N-1)/N"
        b = b_reduce
    elif b_gather == b_reduce:
        b = b_gather
        total = (gathers + 1) * psi * b * (n - 1) // n
        formula = f"{gathers + 1}*psi*b*({g}-1)/{g}"
    else:
        b = f"{b_gather} (gather), {b_reduce} (reduce)"
        total = (gathers * b_gather + b_reduce) * psi * (n - 1) // n
        formula = f"({gathers}*b_gather + b_reduce)*psi*({g}-1)/{g}"
    across = 0
    if sharding.hybrid:
        across = int(2 * psi * b_replica * (r - 1) // (r * n))
        formula += " + 2*psi*b_reduce*(R-1)/(R*S)" if b_gather != b_reduce else " + 2*psi*b*(R-1)/(R*S)"
    kept = (
        "measured is lower by the root unit's backward gather (it stays gathered from forward "
        "to backward) and higher by padding rows"
    )
    notes = {
        "full_shard": kept,
        "shard_grad_op": "one gather in forward, one reduce-scatter; padding rows add a little",
        "no_shard": "DDP's all-reduce; the gradient-norm all-reduce adds 4 bytes",
        "hybrid_shard": kept + "; the replica all-reduce moves each rank's reduced shard across "
        "the replicas",
        "hybrid_shard_grad_op": "one gather in forward and one reduce-scatter in the shard group, "
        "then the replica all-reduce of each rank's reduced shard; padding rows add a little",
    }
    total = int(total)
    return {
        "formula": formula,
        "bytes": total + across,
        "within": total,
        "across": across,
        "replicas": r,
        "shard": n,
        "psi": psi,
        "b": b,
        "note": notes[strategy],
    }


def dtype_table(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, show: bool = True) -> list[dict]:
    """Per unit: the dtype of storage (shards), compute (gathered), communication (gather),
    reduction (gradients) and optimizer state. Printed when ``show``; returned as rows."""
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
            "communication": _short(u.compute_dtype) if isinstance(u, ShardedUnit) else "-",
            "reduction": _short(u.reduce_dtype),
            "optimizer_state": ",".join(sorted(_short(d) for d in state)) or _short(storage),
        })
    if show and rows:
        cols = list(rows[0])
        widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
        print("  ".join(c.ljust(widths[c]) for c in cols))
        for r in rows:
            print("  ".join(str(r[c]).ljust(widths[c]) for c in cols))
    return rows


def _short(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.") if dtype is not None else "-"
