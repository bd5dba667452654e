"""Replica groups outside the job (shardwise.core.replica_groups) built on plain process groups, for tests: a
pool of 4 ranks stands for 2 jobs of 2 ranks; rank r of each job averages its gradient shards
with rank r of the other through a group of its own, as torchft's manager does across jobs
(the groups that do not take part in a step send zeros; the sum is divided by the number
that do). Also the training loop both the fault-tolerance jobs (ft_job.py) and their
references run, so that a reference replays a job's steps exactly."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from nets import batch, loss_of, make, wrap_policy

import shardwise

GROUP_SIZE = 2


class PlainGroups:
    """``shardwise.core.replica_groups.ReplicaGroups`` over ``group`` (rank r of every job); ``taking_part``
    names the groups of the current step."""

    def __init__(self, group, index: int, groups: int):
        self.group, self.index = group, index
        self.taking_part = set(range(groups))

    def attach(self, model) -> None:
        pass

    def all_reduce(self, tensor: torch.Tensor):
        if self.index not in self.taking_part:
            tensor.zero_()
        return _Averaged(dist.all_reduce(tensor, group=self.group, async_op=True), tensor, self.size())

    def size(self) -> int:
        return len(self.taking_part)


class _Averaged:
    def __init__(self, work, tensor: torch.Tensor, n: int):
        self.work, self.tensor, self.n = work, tensor, n

    def wait(self) -> bool:
        self.work.wait()
        self.tensor /= self.n  # as torchft's Manager.allreduce averages
        return True


_groups: dict = {}


def jobs_in_pool(group_size: int = GROUP_SIZE):
    """(the job's group, the group of this rank's peers in the other jobs, job index) for this
    rank of the pool, whose ranks split into jobs of ``group_size`` consecutive ranks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if group_size not in _groups:
        jobs = [dist.new_group(list(range(j, j + group_size))) for j in range(0, world, group_size)]
        peers = [dist.new_group(list(range(r, world, group_size))) for r in range(group_size)]
        _groups[group_size] = (jobs, peers)
    jobs, peers = _groups[group_size]
    return jobs[rank // group_size], peers[rank % group_size], rank // group_size


def options_of(cfg: dict) -> dict:
    """shard()'s options from a job's JSON: ``strategy``, ``mixed_precision``, ``comm`` (with
    ``error_feedback``), ``owned`` (placement of the blocks' matrices)."""
    out = {k: cfg[k] for k in ("strategy", "shard_size", "mixed_precision") if k in cfg}
    if cfg.get("comm"):
        out["comm"] = dataclasses.replace(shardwise.Comm.of(cfg["comm"]), error_feedback=cfg.get("error_feedback", False))
    if cfg.get("owned"):
        out["placement"] = shardwise.placement.matrices
    return out


def build(outer, *, group=None, kind: str = "tied", strategy: str = "full_shard", lr: float = 1e-2, **options):
    """The model and optimizer every fault-tolerance test trains (``options`` go to shard())."""
    model = shardwise.shard(
        make(kind), wrap=wrap_policy("by_class", kind), strategy=strategy, group=group, fault_tolerance=outer,
        **options,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return model, opt


def scaler_of(model, cfg: dict):
    """fp16's loss scaler for a job's JSON ``cfg`` (from its ``init_scale``, if given), else None."""
    if cfg.get("mixed_precision") != "fp16":
        return None
    return shardwise.GradScaler(model, init_scale=cfg.get("init_scale", 2.0**16))


def group_batch(kind: str, step: int, job: int, per_rank: int, group_size: int):
    """Job ``job``'s batch of committed step ``step`` (each job reads its own data)."""
    return batch(kind, 1000 * job + step, per_rank * group_size)


def rank_slice(t: torch.Tensor, rank: int, group_size: int) -> torch.Tensor:
    per = t.shape[0] // group_size
    return t[rank * per : (rank + 1) * per]


def forward_backward(model, kind: str, step: int, job: int, rank: int, group_size: int, per_rank: int = 2, scale=None):
    x, y = group_batch(kind, step, job, per_rank, group_size)
    loss = loss_of(model, rank_slice(x, rank, group_size), rank_slice(y, rank, group_size))
    (scale.scale(loss) if scale is not None else loss).backward()
    return loss.detach()


def rank_state(model, opt) -> dict:
    """This rank's shards and optimizer state, by name (what two groups compare bitwise)."""
    names = {id(p): n for n, p in model.named_parameters()}
    state = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            state[f"optim.{names[id(p)]}.{k}"] = v.detach().clone() if torch.is_tensor(v) else torch.tensor(v)
    return state


def replay(record: list[list[int]], steps: int, cfg: dict, healed: dict[int, list[int]], kind: str = "tied"):
    """Train 2 jobs in the pool of 4 as a job's JSON ``cfg`` says, with the given participation
    (``record[s]``: the jobs that took part in committed step s) and no failure; return this
    rank's final state. A step fp16's scaler skips is taken again, as the jobs do. A job that
    joined at step s (``s in healed[job]``) starts its error feedback residuals afresh there,
    as a healed rank does (shardwise.ft.heal)."""
    job_group, peers, job = jobs_in_pool()
    outer = PlainGroups(peers, job, groups=2)
    model, opt = build(outer, group=job_group, kind=kind, **options_of(cfg))
    scaler = scaler_of(model, cfg)
    rank = dist.get_rank(job_group)
    step = 0
    while step < steps:
        outer.taking_part = set(record[step])
        if step in healed.get(job, ()):
            for unit in shardwise.units(model):
                unit.residuals = {}
        forward_backward(model, kind, step, job, rank, GROUP_SIZE, scale=scaler)
        took = scaler.step(opt) if scaler else opt.step() is None
        if scaler:
            scaler.update()
        opt.zero_grad()
        step += int(took)
    state = rank_state(model, opt)
    state.update(residuals(model))
    return state


def residuals(model) -> dict:
    """This rank's error feedback residuals, by unit and kind."""
    return {f"residual.{i}.{k}": t.clone() for i, u in enumerate(shardwise.units(model)) for k, t in u.residuals.items()}
