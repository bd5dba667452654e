"""The optimizers ``shardwise bench`` gives each system, and its exactness check against one
process (``--optimizer muon``: whole-matrix optimizers, docs/benchmarks.md).

Under ``muon`` the blocks' matrices get ``torch.optim.Muon`` and every other parameter AdamW,
in every system but shardwise in rows: Muon on row slices would be wrong (shardwise refuses
it), so that system keeps AdamW everywhere, the comparison's baseline. shardwise's "+owned"
systems shard with ``placement=shardwise.placement.matrices``; FSDP2 steps Muon on its DTensor
shards, which gather inside the step.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

OPTIMIZERS = ("adamw", "muon")


def whole_matrix(name: str, optimizer: str) -> bool:
    """Whether system ``name`` steps Muon on the blocks' matrices under ``optimizer``."""
    if optimizer != "muon" or name == "floor":
        return False
    return not name.startswith("shardwise/") or name.endswith("+owned")


def make_optimizers(name: str, model: nn.Module, block: type[nn.Module], optimizer: str) -> list:
    """AdamW on everything, or Muon on the matrices inside ``block`` modules and AdamW on the
    rest (same learning rates in every system)."""
    if not whole_matrix(name, optimizer):
        return [torch.optim.AdamW(model.parameters(), lr=1e-3)]
    in_blocks = {id(p) for m in model.modules() if isinstance(m, block) for p in m.parameters()}
    matrices = [p for p in model.parameters() if id(p) in in_blocks and p.ndim == 2]
    chosen = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in chosen]
    return [torch.optim.Muon(matrices, lr=2e-2), torch.optim.AdamW(rest, lr=1e-3)]


def orthogonalized(g: torch.Tensor, steps: int = 5, coefficients=(3.4445, -4.7750, 2.0315)) -> torch.Tensor:
    """Muon's quintic Newton–Schulz iteration in fp32, over the last two dims (batched over
    any others, as stacked experts' matrices)."""
    a, b, c = coefficients
    x = g.to(torch.float32)
    wide = x.size(-2) > x.size(-1)
    if wide:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if wide else x


@contextlib.contextmanager
def fp32_newton_schulz():
    """Run torch.optim.Muon's Newton–Schulz in fp32 (it runs in bf16). For exactness checks
    only: in bf16 the last-bit difference between a data-parallel gradient sum and one
    process's flips a rounding now and then, which the iteration amplifies, so every
    data-parallel system, DDP included, drifts ~1e-3 from one process within a few steps;
    in fp32 a system that orthogonalizes the whole matrix stays within rounding."""
    import torch.optim._muon as muon

    stock = muon._zeropower_via_newtonschulz
    muon._zeropower_via_newtonschulz = lambda g, coefficients, steps, eps: orthogonalized(g, steps, coefficients)
    try:
        yield
    finally:
        muon._zeropower_via_newtonschulz = stock


def full_state(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The unsharded parameters on rank 0 (None elsewhere), whichever system holds them."""
    from .. import api

    if hasattr(model, "_shardwise"):
        full = api.full_state_dict(model)
    elif isinstance(model, nn.parallel.DistributedDataParallel):
        full = {k: v.detach().cpu() for k, v in model.module.state_dict().items()}
    else:  # FSDP2: DTensors
        full = {k: v.full_tensor().detach().cpu() for k, v in model.state_dict().items()}
    return full if dist.get_rank() == 0 else None


def exact_visit(name: str, build, train_step, work, optimizer: str, seed: int) -> float | None:
    """Largest difference of the blocks' matrices (Muon's, under ``muon``) on rank 0 between
    system ``name`` after every batch of ``work`` and one process that trains the unsharded
    model with the same optimizers on the global batches (every rank's, in rank order);
    Muon's Newton–Schulz in fp32 in both."""
    if name == "floor":  # each rank trains its own batch: not the global one
        return None
    with fp32_newton_schulz():
        model, opts, autocast = build(name)
        for x, y in work.batches:
            train_step(model, opts, autocast, work, x, y)
        full = full_state(model)
        batches = [(_global(x), _global(y)) for x, y in work.batches]
        if full is None:
            return None
        torch.manual_seed(seed)
        ref = work.build().to(next(iter(full.values())).device)
        ref_opts = make_optimizers(name, ref, work.block, optimizer)
        for x, y in batches:
            train_step(ref, ref_opts, contextlib.nullcontext, work, x, y)
        matrices = {
            f"{mname}.{pname}" if mname else pname
            for mname, m in ref.named_modules()
            if isinstance(m, work.block)
            for pname, p in m.named_parameters()
            if p.ndim == 2
        }
        return max((full[k] - ref.state_dict()[k].cpu()).abs().max().item() for k in matrices)


def _global(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` concatenated in rank order (collective)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return torch.cat(parts).cpu()
