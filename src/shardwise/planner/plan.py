"""The planner: what each rank will hold and send, before launch and on no GPU.

    shardwise plan --model-size medium --world-size 8 --batch-size 8 --budget 24GiB
    shardwise.plan(lambda: GPT(cfg), world_size=8, batch_size=8, seq_len=256)

It runs the real thing, once per configuration: this process stands for rank 0 of N in a
fake world (torch's "fake" process group: nothing is sent; ``groups.fake_world``) and the
tensors are fake (torch's ``FakeTensorMode``: shapes and dtypes, no memory). The model is
built on the meta device and ``shard()`` lays it out and initialises it one module at a time,
as for a real run; activation checkpointing is applied and the optimizer built; one step
reaches the steady state (optimizer state, the orders the runtime records), and a second is
traced with ``shardwise.trace``, whose categories are read from the runtime's own buffers and
whose allocation log comes from the fake tensors (every storage an operator creates, a
resize or a free). The estimate is read off that trace, and the bytes sent off the
collectives' own counters. There is no second model of the schedule: what the runtime does,
the plan shows.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import collectives, events, groups
from .. import placement as placements
from ..activation_offload import is_activation
from ..api import shard
from ..build import select_units
from ..errors import ShardwiseError
from ..observer.allocations import _FakeAllocations
from ..observer.trace import trace, when
from ..placement import Placement
from ..policies import Comm, MixedPrecision, Settings, Sharding, UnitConfig
from ..recompute import checkpoint_activations
from ..scaler import GradScaler
from ..wrap import Policy
from . import budget as search
from .costs import rates as measured_rates

STRATEGIES = tuple(s.value for s in Sharding if not s.hybrid)  # side by side unless one is named
HYBRID = tuple(s.value for s in Sharding if s.hybrid)  # planned when named, with shard_size
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class UnitRow:
    """One unit as every rank holds it (bytes per rank; the padded flat buffers)."""

    name: str
    params: int  # parameter elements, without padding
    shard_bytes: int
    gathered_bytes: int  # its full parameters in the compute dtype while gathered
    owned: tuple[tuple[str, int, int], ...] = ()  # (parameter, owner rank, bytes): owned placement


@dataclass(frozen=True)
class Estimate:
    """The prediction for one configuration: bytes per rank (the largest rank's), per step."""

    strategy: Sharding
    wrap: str
    world_size: int
    mixed_precision: str
    cpu_offload: bool
    activation_checkpointing: bool
    units: tuple[UnitRow, ...]
    param_shards: int  # whole parameters for no_shard
    gradients: int  # gradient shards (whole gradients for no_shard) after backward
    optimizer: int  # optimizer state
    gathered_peak: int  # most bytes of gathered parameters at one moment
    activations: int  # activations and temporaries of one micro-batch at their peak
    peak: int  # the device's predicted peak; on a CPU run, host and device (Note [one memory])
    peak_at: str  # when it happens
    # host memory with offload (shards, gradients, state, the step's temporaries; activations'
    # host copies); 0 where host and device are one memory (a CPU run: ``peak`` counts both,
    # Note [one memory])
    host: int
    comm: dict[str, int] = field(default_factory=dict)  # bytes sent per step, by collective
    # peaks by stage: "shard" (shard() itself, host and device) and "after_shard" (what it
    # leaves), then on the device "forward", "backward" (the loss included) and "optimizer"
    # (the host's, with cpu_offload on a GPU)
    phases: dict[str, int] = field(default_factory=dict)
    settings: Settings | None = None  # what shard(plan=...) applies for it

    @property
    def model_state(self) -> int:
        """Parameter shards, gradients and optimizer state: what a step leaves behind."""
        return self.param_shards + self.gradients + self.optimizer

    @property
    def sent(self) -> int:
        return sum(self.comm.values())

    @property
    def label(self) -> str:
        parts = [f"{self.strategy}" + ("" if self.strategy.shard else " (DDP)")]
        if self.wrap != "-":
            parts.append(f"wrap {self.wrap}")
        if self.activation_checkpointing:
            parts.append("checkpointing")
        if self.cpu_offload:
            parts.append("offload")
        return ", ".join(parts)


@dataclass
class Plan:
    """Estimates side by side; with a budget, the search's path (planner/budget.py), the
    fastest configuration on it that fits, and why."""

    estimates: list[Estimate]
    title: str
    budget: int | None = None
    choice: Estimate | None = None
    reason: str = ""
    one_memory: bool = False  # a CPU run: host and device are one memory (Note [one memory])
    path: list[search.Step] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # moves that lowered nothing

    @property
    def settings(self) -> Settings:
        """The chosen configuration, as ``shard(model, plan=...)`` applies it."""
        if self.choice is None or self.choice.settings is None:
            raise ShardwiseError(
                f"this plan chose nothing to apply: {self.reason or 'it was made without budget='}"
            )
        return self.choice.settings

    def __str__(self) -> str:
        return render(self)


# --- the model on the meta device
def _meta_factory(model: nn.Module | Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """A function that builds a fresh meta-device copy of the model each time it is called."""
    if isinstance(model, nn.Module):

        def twin() -> nn.Module:
            memo = {}
            for t in [*model.parameters(), *model.buffers()]:
                if id(t) not in memo:
                    meta = torch.empty_like(t, device="meta")
                    memo[id(t)] = (
                        nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
                    )
            return copy.deepcopy(model, memo)

        return twin
    if not callable(model):
        raise TypeError(
            f"plan() takes an nn.Module or a function that builds one, got {type(model).__name__}"
        )

    def build() -> nn.Module:
        with torch.device("meta"):
            m = model()
        if not isinstance(m, nn.Module):
            raise TypeError(f"the model factory returned {type(m).__name__}, not an nn.Module")
        return m

    return build


# --- one configuration, run on fake tensors in the fake world
@dataclass(frozen=True)
class _Job:
    """What the configurations of one plan share: the model, the step and the options."""

    build: Callable[[], nn.Module]
    micro_batch: Callable[[], tuple]
    loss: Callable[..., torch.Tensor] | None
    optimizer: OptimizerFactory
    precision: MixedPrecision
    precision_name: str
    checkpointing: Policy | None
    max_unsharded: int
    shard_size: int | None  # hybrid strategies' shard groups
    placement: Placement | None = None
    comm: Comm | str | None = None


def _no_values(module: nn.Module) -> None:
    """shard()'s initialiser in the planner: fake tensors hold no values to set."""


def _step(job: _Job, model: nn.Module, opt: torch.optim.Optimizer, scaler, around_forward=None) -> None:
    """One training step as the user's loop takes it: forward, loss, backward, optimizer step
    (a GradScaler's finite check reads values, which fake tensors lack: the step is taken).
    ``around_forward``: a context the forward and the loss run in (the search's profile)."""
    args = job.micro_batch()
    with around_forward or contextlib.nullcontext():
        out = job.loss(model, *args) if job.loss is not None else model(*args)
    loss = out if out.dim() == 0 else out.float().sum()
    (scaler.scale(loss) if scaler is not None else loss).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _run(job: _Job, settings: Settings, checkpointing: bool, profile: search.Profile | None = None):
    """Shard as ``settings`` say (with ``checkpointing``, also ``job.checkpointing``'s
    modules), take a step, trace the next: the trace, the optimizer's name, shard()'s own
    peak and final bytes (its log, as the tracer keeps one) and the bytes of activations in
    host memory after each ``activations`` event of the trace (Note [host copies] in
    activation_offload.py). A ``profile`` given gets the units' forward FLOPs and saved activations
    from the first step."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # imports sympy: only when planning

    model = job.build()
    with FakeTensorMode(allow_non_fake_inputs=True):  # (the meta model's tensors are not fake)
        log = _FakeAllocations()
        log.start()
        try:
            shard(
                model,
                plan=settings,
                mixed_precision=job.precision,
                max_unsharded=job.max_unsharded,
                init=_no_values,
                placement=job.placement,
                comm=job.comm,
                **({"shard_size": job.shard_size} if settings.strategy.hybrid else {}),
            )
        finally:
            entries = log.stop()
        if checkpointing:
            checkpoint_activations(model, job.checkpointing)
        opt = job.optimizer(list(model.parameters()))
        scaler = GradScaler(model) if job.precision.needs_loss_scaling else None
        _step(job, model, opt, scaler, _profiling(model, settings, profile) if profile else None)
        host: list[int] = []

        def note(name: str, unit: str, t: float, **fields) -> None:
            if name == "activations":
                host.append(fields["host"])

        with trace(model, opt) as t:
            events.listen(note)  # (inside the trace: the two hear the same events)
            try:
                _step(job, model, opt, scaler)
            finally:
                events.unlisten(note)
    return t.data, type(opt).__name__, _peak_and_end(entries), host


@contextlib.contextmanager
def _profiling(model: nn.Module, settings: Settings, profile: search.Profile):
    """Inside (a forward), count each unit's forward FLOPs (torch's FlopCounterMode, by
    module) and the bytes of activations it saves for backward (parameters excluded): what
    recomputing it costs and saves. A tensor saved inside nested units counts for the
    innermost."""
    from torch.utils.flop_counter import FlopCounterMode

    modules = dict(model.named_modules())
    stack: list[str] = []  # the units whose forward is running, innermost last

    def enter(name: str):
        def hook(*_) -> None:
            stack.append(name)

        return hook

    def leave(*_) -> None:
        stack.pop()

    hooks = []
    for name, _ in settings.units:
        hooks.append(modules[name].register_forward_pre_hook(enter(name)))
        hooks.append(modules[name].register_forward_hook(leave, always_call=True))

    def pack(t: torch.Tensor) -> torch.Tensor:
        if stack and is_activation(t):
            profile.saved_bytes[stack[-1]] = profile.saved_bytes.get(stack[-1], 0) + t.numel() * t.element_size()
        return t

    counter = FlopCounterMode(display=False)
    try:
        with counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
    finally:
        for h in hooks:
            h.remove()
    counts = counter.get_flop_counts()
    top = type(model).__name__
    for name, _ in settings.units:
        profile.forward_flops[name] = sum(counts.get(f"{top}.{name}" if name else top, {}).values())


def _peak_and_end(entries: list[tuple[int, int, int, int]]) -> tuple[int, int]:
    """The highest total of an allocation log and what it ends with."""
    live: dict[int, int] = {}
    total = peak = 0
    for _, key, n, _ in entries:
        total += max(0, n) - live.pop(key, 0)
        if n > 0:
            live[key] = n
        peak = max(peak, total)
    return peak, total


# Note [one memory]: under Gloo shardwise computes on the CPU, so the "device" is host memory:
# offload of a unit's state (shards, gradients, optimizer state) or of its activations moves
# bytes from one part of that memory to another and saves nothing (it adds the copies). The
# estimate's peak then counts all of it, host and device together, and a budget never tries
# offload there (ONE_MEMORY says why). Under NCCL they are two memories: the device peak leaves
# out what offload keeps on the host (the state's share, landed gradients, and the activations'
# host copies, Note [host copies] in activation_offload.py), and ``host`` counts it.
ONE_MEMORY = (
    "on CPU (gloo) host and device are one memory: offload of state or of activations moves "
    "bytes within it and saves nothing, so the peak counts both and a budget never chooses "
    "either"
)


def _estimate(
    data: dict,
    shard_bytes: tuple[int, int],
    settings: Settings,
    host_activations: list[int],
    *,
    checkpointing: bool,
    precision_name: str,
    one_memory: bool,
) -> Estimate:
    """The estimate read off a traced step (rank 0's record; see the module doc). With
    offload on a GPU the host holds the offloaded units' shards, optimizer state and landed
    gradients; the device the rest, with the optimizer step's temporaries where any unit
    steps there (all of them: an upper bound, as which are made on the host depends on the
    optimizer's implementation). Offloaded activations are on the host from their copy out to
    their copy back (``host_activations``: the bytes there after each ``activations`` event).
    On a CPU run both are one memory, and the peak is all of it (Note [one memory])."""
    offloaded = [c.offload for _, c in settings.units]  # (in the runtime's order of units)
    split = any(offloaded) and not one_memory  # host and device apart
    rank, cats = data["ranks"][0], data["categories"]
    rows = [dict(zip(cats, m[2:-1]), peak=m[-1]) for m in rank["memory"] if m[1] == "cpu"]
    labels, stages = when(rank, data["units"])
    after_backward = stages.index("optimizer") - 1  # the sample as the optimizer begins
    step = [r for r, s in zip(rows, stages) if s == "optimizer"]
    held = [0] * len(rows) if one_memory else _held(rank, host_activations)
    state = [0.0] * len(rows)  # on the host: offloaded state and gradients landed there
    share = 0.0  # of the shards' bytes, offloaded
    if split:
        landed = _landed(rank, data["units"], offloaded)
        # the offloaded units' share of the shards, and of the optimizer state (as large as
        # the shards it steps, per element)
        sizes = [u["shard_bytes"] for u in data["units"]]
        share = sum(b for b, o in zip(sizes, offloaded) if o) / max(1, sum(sizes))
        state = [share * (r["param_shards"] + r["optimizer"]) + g for r, g in zip(rows, landed)]
    # the optimizer step's temporaries are the device's unless all the state steps on the host
    device = [
        r["peak"] - a - h - (r["peak"] - sum(r[c] for c in cats) if share == 1 and s == "optimizer" else 0)
        for r, s, a, h in zip(rows, stages, state, held)
    ]
    host = max(a + h for a, h in zip(state, held))
    top = max(range(len(rows)), key=device.__getitem__)
    phases = {"shard": shard_bytes[0], "after_shard": shard_bytes[1]}
    for stage in ("forward", "backward", "optimizer"):
        phases[stage] = max((d for d, s in zip(device, stages) if s == stage), default=0)
    return Estimate(
        strategy=settings.strategy,
        wrap=_policy_name(settings.wrap) if settings.strategy.shard else "-",
        world_size=data["world_size"],
        mixed_precision=precision_name,
        cpu_offload=any(offloaded),
        activation_checkpointing=checkpointing or any(c.checkpoint != "none" for _, c in settings.units),
        units=tuple(
            UnitRow(u["name"], u["params"], u["shard_bytes"], u["gathered_bytes"], tuple(map(tuple, u.get("owned", ()))))
            for u in data["units"]
        ),
        param_shards=rows[after_backward]["param_shards"],
        gradients=rows[after_backward]["gradients"],
        optimizer=rows[-1]["optimizer"],
        gathered_peak=max(r["gathered"] for r in rows),
        activations=max(r["activations"] - h for r, h in zip(rows, held)),
        peak=int(device[top]),
        peak_at=labels[top],
        host=int(max(host, *(r["peak"] for r in step)) if split else host),
        comm=_mean_comm(rank["comm"], data["world_size"], data["units"]),
        phases={k: int(v) for k, v in phases.items()},
        settings=settings,
    )


def _mean_comm(comm: dict, world: int, units: list[dict]) -> dict[str, int]:
    """Bytes sent per step by collective. With owned parameters a rank's gathers and
    reductions move the whole less its own share, which differs between ranks: their mean,
    (N-1)/N of the whole as for rows, stands for every rank."""
    owned = any(u.get("owned") for u in units)
    return {
        k: c["payload_bytes"] * (world - 1) // world if owned and k in ("all_gather", "reduce_scatter") else c["bytes"]
        for k, c in comm.items()
        if k != "broadcast"
    }


def _held(rank: dict, host: list[int]) -> list[int]:
    """For each CPU memory sample, the bytes of activations in host memory through the
    interval it closes: those after the last ``activations`` event before it (Note [host
    copies] in activation_offload.py)."""
    times = [e[0] for e in rank["events"] if e[1] == "activations"]
    assert len(times) == len(host), f"rank 0: {len(times)} activations events, {len(host)} heard"
    out, k, now = [], 0, 0
    for sample in rank["memory"]:
        if sample[1] == "cpu":
            while k < len(times) and times[k] < sample[0]:
                now, k = host[k], k + 1
            out.append(now)
    return out


def _landed(rank: dict, units: list[dict], offloaded: list[bool]) -> list[int]:
    """For each CPU memory sample, the bytes of gradient shards landed in host memory so far
    (an offloaded unit's when its reduction is done; as large as its shard)."""
    size = [u["shard_bytes"] if o else 0 for u, o in zip(units, offloaded)]
    done = sorted((e[0], size[e[2]]) for e in rank["events"] if e[1] == "reduce_done")
    out, k, total = [], 0, 0
    for sample in rank["memory"]:
        if sample[1] == "cpu":
            while k < len(done) and done[k][0] <= sample[0]:
                total += done[k][1]
                k += 1
            out.append(total)
    return out


# --- the public function
def _one_plan_for_all(plan_here: Callable[..., Plan]) -> Callable[..., Plan]:
    """``plan_here`` as every rank of a run should call it: inside a run of several ranks
    (torchrun, after ``init()``) rank 0 plans and every rank returns its plan, or raises its
    error, so that all of them shard alike whatever their inputs; elsewhere (one rank, no
    process group yet) this process plans alone."""

    @functools.wraps(plan_here)
    def plan(*args, **kwargs) -> Plan:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return plan_here(*args, **kwargs)
        box: list = [None]
        failure = None
        if dist.get_rank() == 0:
            try:
                box[0] = (True, plan_here(*args, **kwargs))
            except Exception as exc:
                failure = exc
                box[0] = (False, f"{type(exc).__name__}: {exc}")
        collectives.blocking("broadcast", "plan", dist.broadcast_object_list, box, src=0)
        ok, value = box[0]
        if failure is not None:
            raise failure
        if not ok:
            raise ShardwiseError(f"plan() failed on rank 0, which plans for every rank: {value}")
        return value

    return plan


@_one_plan_for_all
def plan(
    model: nn.Module | Callable[[], nn.Module],
    *,
    world_size: int = 1,
    strategy: str | Sequence[str] | None = None,
    wrap: Policy | None = None,
    mixed_precision: MixedPrecision | str | None = None,
    cpu_offload: bool = False,
    activation_checkpointing: Policy | None = None,
    batch_size: int = 1,
    seq_len: int | None = None,
    inputs: Callable[[], tuple] | None = None,
    loss: Callable[..., torch.Tensor] | None = None,
    optimizer: OptimizerFactory | None = None,
    max_unsharded: int = 2,
    shard_size: int | None = None,
    backend: str | None = None,
    budget: int | str | None = None,
    placement: Placement | None = None,
    comm: Comm | str | None = None,
) -> Plan:
    """Predict each rank's memory and traffic for a training step by running shardwise's
    runtime on fake tensors in a fake world of ``world_size`` ranks (see the module doc).

    model: an ``nn.Module`` (copied to the meta device, never touched) or a function that
    builds one (called under ``torch.device("meta")``). strategy: one, several, or None for
    full_shard, shard_grad_op and no_shard side by side (no_shard is DDP's layout); the hybrid
    strategies when named, over shard groups of ``shard_size`` ranks. wrap, mixed_precision,
    cpu_offload, max_unsharded, placement and comm mean what they mean for ``shard()`` (the plan
    shows which rank owns each owned parameter; its figures are rank 0's); activation_checkpointing is the policy
    ``checkpoint_activations`` would get. The micro-batch is ``inputs()``, positional
    arguments, or by default token ids of ``batch_size`` x ``seq_len`` (default:
    ``model.cfg.seq_len``) passed as ``model(idx, targets)``. The step's loss is
    ``loss(model, *inputs())`` where given (a loss computed outside the model, as most loops
    do: its temporaries count), else the model's output, summed if it is not a scalar.
    ``inputs()`` and ``loss`` run under ``FakeTensorMode``: their tensors allocate nothing.
    optimizer: a function of the parameters that builds it (default ``torch.optim.AdamW``).
    backend: the collectives' backend the run will use, "gloo" or "nccl" (default: nccl where
    CUDA is available, else gloo, as ``shardwise.init`` picks); they lay buffers out differently.

    budget: bytes or a string such as "24GiB": a per-unit configuration of ``wrap``'s units
    that fits, in the least predicted step time (planner/budget.py: a path from DDP through
    sharding, then per unit resharding after forward, recomputation and, on a GPU, offload of
    its state or its activations, the cheapest saving per predicted second first, each move
    planned again). The plan's
    ``settings`` is what ``shard(model, plan=p)`` applies. The strategy, checkpointing and
    offload are then the search's to choose (a hybrid strategy may be named: the search keeps
    its shard groups).

    It plans in this process, anywhere in a script, before or after ``shardwise.init()``: the
    fake world stands beside the run's own (Note [a world beside the real one] in groups.py),
    so the model, ``inputs`` and ``loss`` may be anything callable here, lambdas and
    ``__main__``'s functions included. Inside a run of several ranks it is collective: every
    rank calls it, rank 0 plans, and every rank gets that one plan (or its error).
    """
    build = _meta_factory(model)
    precision = MixedPrecision.of(mixed_precision)
    precision_name = (
        mixed_precision
        if isinstance(mixed_precision, str)
        else f"compute {precision.param_dtype}, reduce {precision.reduce_dtype}".replace(
            "torch.", ""
        )
        if precision.param_dtype or precision.reduce_dtype
        else "fp32"
    )
    if world_size < 1:
        raise ShardwiseError(f"world_size={world_size} must be at least 1")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ShardwiseError(f"backend={backend!r}: plan for 'gloo' (CPU) or 'nccl' (CUDA)")
    strategies = tuple(
        Sharding.of(s)
        for s in (STRATEGIES if strategy is None else (strategy,) if isinstance(strategy, str) else strategy)
    )
    if any(s.hybrid for s in strategies) and shard_size is None:
        raise ShardwiseError(
            "a hybrid strategy needs shard_size= in plan(): the ranks of one shard group "
            "(torchrun's --nproc_per_node, one node, in the run)"
        )
    if cpu_offload and strategy is not None and not all(s.shard for s in strategies):
        raise ShardwiseError(
            "cpu_offload=True needs a sharded strategy: with no_shard every rank keeps whole "
            "parameters on the device anyway. Use strategy='full_shard' or 'shard_grad_op'."
        )
    if budget is not None and (
        activation_checkpointing is not None or cpu_offload or (strategy is not None and not strategies[0].hybrid)
    ):
        raise ShardwiseError(
            "with budget=, plan() chooses the strategy, activation checkpointing and offload per "
            "unit of wrap: leave strategy (other than a hybrid one), activation_checkpointing "
            "and cpu_offload unset"
        )
    probe = build()
    if inputs is None and seq_len is None:
        seq_len = getattr(getattr(probe, "cfg", None), "seq_len", None)
        if seq_len is None:
            raise ShardwiseError(
                "plan() needs seq_len= (or inputs=) to build a micro-batch for this model"
            )

    def tokens() -> tuple:
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
        return ids, ids

    ckpt_policy = activation_checkpointing or wrap
    job = _Job(
        build=build,
        micro_batch=inputs or tokens,
        loss=loss,
        optimizer=optimizer or torch.optim.AdamW,
        precision=precision,
        precision_name=precision_name,
        checkpointing=ckpt_policy,
        max_unsharded=max_unsharded,
        shard_size=shard_size,
        placement=placement,
        comm=comm,
    )
    one_memory = backend == "gloo"  # shardwise computes on the CPU under Gloo
    names = [u.name for u in select_units(probe, wrap)]
    estimates, optimizer_name, steps, dropped = [], "", [], []
    with groups.fake_world(world_size, backend), collectives.apart():

        def run(settings: Settings, checkpointing: bool = False, profile=None) -> Estimate:
            nonlocal optimizer_name
            data, optimizer_name, shard_bytes, host = _run(job, settings, checkpointing, profile)
            return _estimate(
                data, shard_bytes, settings, host,
                checkpointing=checkpointing, precision_name=precision_name, one_memory=one_memory,
            )

        if budget is None:
            for s in strategies:
                uniform = _uniform(names, s, wrap, cpu_offload and s.shard)
                estimates.append(run(uniform, activation_checkpointing is not None))
        else:
            def profile_of(settings: Settings) -> tuple[Estimate, search.Profile]:
                profile = search.Profile({}, {}, {}, {})
                e = run(settings, profile=profile)
                for n, u in zip(names, e.units):
                    profile.gathered_bytes[n], profile.shard_bytes[n] = u.gathered_bytes, u.shard_bytes
                return e, profile

            sharded = (
                (Sharding.HYBRID_SHARD_GRAD_OP, Sharding.HYBRID_SHARD)
                if strategies[0].hybrid
                else (Sharding.SHARD_GRAD_OP, Sharding.FULL_SHARD)
            )
            steps, dropped = search.path(
                names, wrap, sharded, run, profile_of, measured_rates(backend),
                world=world_size, offload=not one_memory,
            )
            estimates = [s.estimate for s in steps]
    n_params = sum(p.numel() for p in probe.parameters())
    tokens_shown = f"{batch_size} x {seq_len}" if inputs is None else "inputs()"
    title = (
        f"{n_params:,} parameters, {world_size} rank{'s' * (world_size > 1)} ({backend}), "
        f"micro-batch {tokens_shown} per rank, {precision_name}, optimizer {optimizer_name}"
    )
    result = Plan(estimates, title, one_memory=one_memory, path=steps, dropped=dropped)
    if budget is not None:
        result.budget = parse_bytes(budget)
        step, result.reason = search.choose(steps, result.budget)
        result.choice = step.estimate if step else None
    return result


def _uniform(names: list[str], strategy: Sharding, wrap: Policy | None, offload: bool) -> Settings:
    """One setting for every unit, as the strategy means it (``offload``: cpu_offload)."""
    keep = strategy.reshard_after_forward
    return Settings(
        strategy, wrap, tuple((n, UnitConfig(reshard_after_forward=keep and bool(n), offload=offload)) for n in names)
    )


def _policy_name(policy: Policy | None) -> str:
    return "none" if policy is None else repr(policy)


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: int | str) -> int:
    """Bytes from an int or a string such as "24GiB", "1.5 GB", "800MiB"."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ShardwiseError(f"budget={value!r}: write a size such as '24GiB', '1.5GB' or '800MiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _fmt(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def render(p: Plan) -> str:
    """The plan as text: units, then one column per configuration."""
    e0 = p.estimates[0]
    lines = [f"shardwise plan: {p.title}", ""]
    shown = {}
    for e in p.estimates:
        if e.strategy.shard:
            shown.setdefault(e.wrap, e)
    for wrap, e in shown.items():
        head = f"units with wrap {wrap} ({len(e.units)}), per rank:"
        lines.append(f"{head:<46}params     shard    gathered")
        for u in e.units:
            lines.append(
                f"  {u.name:<32}{u.params:>12,} {_mib(u.shard_bytes)} {_mib(u.gathered_bytes)} MiB"
            )
        top = sorted(e.units, key=lambda u: -u.gathered_bytes)[:3]
        lines.append(
            "  largest gathered: " + ", ".join(f"{u.name} ({_fmt(u.gathered_bytes)})" for u in top)
        )
        lines.append("")
    cols = p.estimates
    rows = [
        ("parameter shards", lambda e: e.param_shards),
        ("gradients", lambda e: e.gradients),
        ("optimizer state", lambda e: e.optimizer),
        ("= model state", lambda e: e.model_state),
        ("gathered at most", lambda e: e.gathered_peak),
        ("activations (peak)", lambda e: e.activations),
        ("predicted peak " + ("(CPU)" if p.one_memory else "(device)"), lambda e: e.peak),
        ("host (offload)", lambda e: e.host),
        ("sent per step: all-gather", lambda e: e.comm["all_gather"]),
        ("  reduce-scatter", lambda e: e.comm["reduce_scatter"]),
        ("  all-reduce", lambda e: e.comm["all_reduce"]),
    ]
    if any(e.comm.get("replica_all_reduce") for e in cols):  # hybrid: the link across groups
        rows.append(("  across shard groups", lambda e: e.comm.get("replica_all_reduce", 0)))
    for start in range(0, len(cols), 4):
        chunk = cols[start : start + 4]
        heads = [f"path {start + j}" if p.path else _short(e) for j, e in enumerate(chunk)]
        lines.append(f"{'per rank, MiB':<27}" + "".join(f"{h:>26}" for h in heads))
        for name, get in rows:
            lines.append(f"  {name:<25}" + "".join(f"{_mib(get(e)):>26}" for e in chunk))
        lines.append(f"  {'peak happens at':<25}" + "".join(f"{e.peak_at[:25]:>26}" for e in chunk))
        lines.append("")
    if any(c.wrap == "none" or c.activation_checkpointing or c.cpu_offload for c in cols):
        lines.append("columns: +root = no wrap (one unit), +ac = checkpointing, +off = cpu offload")
    owned = _owned_by_rank(e0)
    if owned:
        lines.append(
            "owned parameters, whole on one rank each (figures above: rank 0's): "
            + ", ".join(f"rank {r} {n} ({_fmt(b)})" for r, (n, b) in sorted(owned.items()))
        )
        for u in e0.units:
            if u.owned:
                lines.append(f"  {u.name}: " + ", ".join(f"{name} -> {r}" for name, r, _ in u.owned))
    elif e0.world_size > 1:
        lines.append(
            "ranks hold equal padded buffers; rank 0 the most optimizer state (most rows)."
        )
    if p.one_memory and (p.budget is not None or any(c.cpu_offload for c in cols)):
        lines.append(ONE_MEMORY + ".")
    if p.budget is not None:
        lines += ["", "the search's path, fastest first (planner/budget.py):"]
        lines += [f"  {i}. {s.why}" for i, s in enumerate(p.path)]
        if p.dropped:
            lines.append("  dropped: " + "; ".join(p.dropped))
        lines.append(f"budget {_fmt(p.budget)}: " + ("choose " if p.choice else "") + p.reason)
        if p.choice is not None:
            lines += search.table(p.choice.settings)
    return "\n".join(lines)


def _owned_by_rank(e: Estimate) -> dict[int, tuple[int, int]]:
    """Per owner rank: how many parameters it owns and their bytes."""
    out: dict[int, tuple[int, int]] = {}
    for u in e.units:
        for _, r, b in u.owned:
            n, total = out.get(r, (0, 0))
            out[r] = (n + 1, total + b)
    return out


def _short(e: Estimate) -> str:
    """A column header: the strategy, then +root (wrap none), +ac (checkpointing), +off."""
    name = f"{e.strategy}" + ("" if e.strategy.shard else " (DDP)")
    return (
        name
        + ("+root" if e.wrap == "none" else "")
        + ("+ac" if e.activation_checkpointing else "")
        + ("+off" if e.cpu_offload else "")
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:9.2f}"


# --- the command
def main(argv: list[str] | None = None) -> None:
    """``shardwise plan``: the planner on the built-in GPT."""
    from ..models import GPT, Block, gpt_config
    from ..wrap import by_class, by_size

    ap = argparse.ArgumentParser(
        prog="shardwise plan",
        description="predict per-rank memory and traffic of the built-in GPT, before launch",
    )
    ap.add_argument("--model-size", choices=("tiny", "small", "medium", "large"), default="small")
    ap.add_argument("--world-size", type=int, default=2, help="ranks")
    ap.add_argument(
        "--strategy", choices=STRATEGIES + HYBRID, help="one strategy (default: the first three side by side)"
    )
    ap.add_argument("--shard-size", type=int, help="hybrid strategies: ranks per shard group")
    ap.add_argument(
        "--wrap",
        choices=("block", "size", "none"),
        default="block",
        help="which modules become units",
    )
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--mixed-precision", choices=("none", "bf16", "fp16"), default="none")
    ap.add_argument("--cpu-offload", action="store_true")
    ap.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute block activations in backward",
    )
    ap.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        help="the run's collectives (default: nccl where CUDA is available, else gloo)",
    )
    ap.add_argument(
        "--placement",
        choices=("rows", "matrices"),
        default="rows",
        help="matrices: the blocks' matrices owned whole by one rank each (for Muon)",
    )
    ap.add_argument(
        "--budget",
        help="device memory per rank, e.g. 24GiB: pick the cheapest configuration that fits",
    )
    a = ap.parse_args(argv)
    cfg = gpt_config(a.model_size, seq_len=a.seq_len)
    wrap = {"block": by_class(Block), "size": by_size(1_000_000), "none": None}[a.wrap]
    result = plan(
        functools.partial(GPT, cfg),
        world_size=a.world_size,
        strategy=a.strategy,
        wrap=wrap,
        mixed_precision=None if a.mixed_precision == "none" else a.mixed_precision,
        cpu_offload=a.cpu_offload,
        activation_checkpointing=by_class(Block) if a.activation_checkpointing else None,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        shard_size=a.shard_size,
        backend=a.backend,
        budget=a.budget,
        placement=placements.matrices if a.placement == "matrices" else None,
    )
    print(f"GPT {a.model_size}: " + str(result))
