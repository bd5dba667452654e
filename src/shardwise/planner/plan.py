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

import contextlib
import copy
import dataclasses
import functools
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from ..api import shard
from ..core import collectives, events, groups
from ..core.activation_offload import is_activation
from ..core.build import select_units
from ..core.errors import ShardwiseError
from ..core.placement import Placement
from ..core.policies import Comm, MixedPrecision, Settings, Sharding, UnitConfig
from ..core.recompute import checkpoint_activations
from ..core.scaler import GradScaler
from ..core.wrap import Policy
from ..observer.accounting import theory
from ..observer.allocations import FakeAllocations
from ..observer.trace import trace
from . import budget as search
from . import repeats as repeats_
from .costs import rates as measured_rates
from .estimate import ONE_MEMORY, Estimate, UnitRow, estimate_of, state_bytes
from .render import Plan

__all__ = ["ONE_MEMORY", "HYBRID", "STRATEGIES", "Estimate", "Plan", "UnitRow", "parse_bytes", "plan"]

STRATEGIES = tuple(s.value for s in Sharding if not s.hybrid)  # side by side unless one is named
HYBRID = tuple(s.value for s in Sharding if s.hybrid)  # planned when named, with shard_size
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

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
    micro_batch: Callable[[], tuple | dict]
    loss: Callable[..., torch.Tensor] | None
    optimizer: OptimizerFactory
    precision: MixedPrecision
    precision_name: str
    checkpointing: Policy | None
    max_unsharded: int
    shard_size: int | None  # hybrid strategies' shard groups
    placement: Placement | None = None
    comm: Comm | str | None = None
    holds_output: bool = True  # the loop holds the model's output to the step's end
    repeats: repeats_.Repeats | None = None  # its blocks alike, planned from a few (repeats.py)


def _no_values(module: nn.Module) -> None:
    """shard()'s initialiser in the planner: fake tensors hold no values to set."""


def _step(job: _Job, model: nn.Module, opt: torch.optim.Optimizer, scaler, around_forward=None) -> None:
    """One training step as the user's loop takes it: forward, loss, backward, optimizer step
    (a GradScaler's finite check reads values, which fake tensors lack: the step is taken).
    The model's outputs are held to the step's end where the loop holds them (Note [the
    loop's references]). ``around_forward``: a context the forward and the loss run in (the
    search's profile)."""
    batch = job.micro_batch()
    args, kwargs = ((), batch) if isinstance(batch, dict) else (batch, {})
    held: list = []  # the model's outputs, as the loop's own variable holds them
    hook = model.register_forward_hook(lambda m, i, out: held.append(out)) if job.holds_output else None
    try:
        with around_forward or contextlib.nullcontext():
            out = job.loss(model, *args, **kwargs) if job.loss is not None else model(*args, **kwargs)
    finally:
        if hook is not None:
            hook.remove()
    loss = _loss_of(out)
    del out  # (the output itself, where the loss was read off it: the loop holds it or not)
    (scaler.scale(loss) if scaler is not None else loss).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


# Note [the loop's references]: what a training loop holds while backward runs is memory the
# model never sees. The usual loop holds the model's output to the step's end,
#     logits = model(x); loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()); loss.backward()
#     out = model(**batch); out.loss.backward()           (Hugging Face's examples)
# and with a large vocabulary that output is one of the largest tensors of the step, live at
# its peak (the backward of the loss and of the head). Others drop it before backward (a loss
# function's own frame, the HF Trainer's compute_loss, Lightning's training_step, torchtitan's
# ``del pred``). plan()'s ``loss(model, *inputs)`` is called as a function, so its frame, and
# the logits with it, were gone before backward: the plan fell 5.2% short of a loop that holds
# them (issue 32: a [512, 4096] fp32 tensor on a 153.6 MiB step). ``holds_output`` says which
# loop runs; holding is the default, the larger of the two.
def _loss_of(out) -> torch.Tensor:
    """The scalar to backpropagate from what the model or ``loss`` returned: a tensor (summed
    if it is not a scalar) or an output with a ``loss`` (Hugging Face's ModelOutput)."""
    loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise ShardwiseError(
            f"the step returned a {type(out).__name__} without a loss tensor: give plan() a "
            "loss= function (loss(model, *inputs()) -> a tensor), or inputs that make the model "
            "return its loss (labels=, for a Hugging Face model)"
        )
    return loss if loss.dim() == 0 else loss.float().sum()


def _run(
    job: _Job, settings: Settings, checkpointing: bool, profile: search.Profile | None = None, blocks: int | None = None
):
    """Shard as ``settings`` say (with ``checkpointing``, also ``job.checkpointing``'s
    modules), take a step, trace the next: the trace, the optimizer's name, shard()'s own
    peak and final bytes (its log, as the tracer keeps one) and the bytes of activations in
    host memory after each ``activations`` event of the trace (Note [host copies] in
    activation_offload.py). A ``profile`` given gets the units' forward FLOPs and saved activations
    from the first step. ``blocks``: the model with that many of its blocks alike (Note
    [blocks alike] in repeats.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # imports sympy: only when planning

    model = job.build()
    if blocks is not None:
        job.repeats.keep(model, blocks)
    with FakeTensorMode(allow_non_fake_inputs=True):  # (the meta model's tensors are not fake)
        log = FakeAllocations()
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
        with _the_step_on_fake_tensors():
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
        state = state_bytes(model, opt)
    for u in t.data["units"]:
        u["state_bytes"] = state[u["name"]]
    return t.data, type(opt).__name__, _peak_and_end(entries), host


@contextlib.contextmanager
def _the_step_on_fake_tensors():
    """A step that fails on fake tensors (and not for a reason of shardwise's own) raises a
    ShardwiseError that says so, with what to do where the cause is known."""
    try:
        yield
    except ShardwiseError:
        raise
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
        hint = (
            " torch's fake kernel of grouped_mm (Mixture-of-Experts layers) takes bf16 only: plan "
            "with mixed_precision='bf16', as such models train."
            if "grouped_mm" in text or "BF16" in text
            else " The step depends on tensor values (data-dependent shapes, e.g. nonzero or a "
            "boolean mask), which fake tensors do not have: give plan() a model whose step does "
            "not (for a Hugging Face MoE, its grouped_mm experts)."
            if "DynamicOutputShape" in text or "data-dependent" in text.lower()
            else ""
        )
        raise ShardwiseError(
            "plan() takes one step of the model on fake tensors (shapes, no values), and it "
            f"failed: {text.splitlines()[0][:300].rstrip('.')}.{hint}"
        ) from exc


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


# --- the public function
def _micro_batch(probe: nn.Module, inputs, batch_size: int, seq_len: int | None) -> tuple[Callable, str]:
    """The step's micro-batch (``inputs``, or token ids of ``batch_size`` x ``seq_len``,
    ``seq_len`` defaulting to the model's ``cfg.seq_len``) and how the plan's title shows it."""
    if inputs is not None:
        return inputs, "inputs()"
    if seq_len is None:
        seq_len = getattr(getattr(probe, "cfg", None), "seq_len", None)
        if seq_len is None:
            raise ShardwiseError("plan() needs seq_len= (or inputs=) to build a micro-batch for this model")

    def tokens() -> tuple:
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
        return ids, ids

    return tokens, f"{batch_size} x {seq_len}"


def _one_plan_for_all(plan_here: Callable[..., Plan]) -> Callable[..., Plan]:
    """``plan_here`` as every rank of a run should call it: inside a run of several ranks
    (torchrun, after ``init()``) rank 0 plans and every rank returns its plan, or raises its
    error, so that all of them shard alike whatever their inputs; elsewhere (one rank, no
    process group yet) this process plans alone."""

    @functools.wraps(plan_here)
    def plan(*args, **kwargs) -> Plan:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return plan_here(*args, **kwargs)
        chosen, problem, failure = None, "", None
        if dist.get_rank() == 0:
            try:
                chosen = plan_here(*args, **kwargs)
            except Exception as exc:
                failure, problem = exc, f"{type(exc).__name__}: {exc}"

        def error(message: str) -> Exception:  # rank 0 raises its own error
            return failure or ShardwiseError(f"plan() failed on rank 0, which plans for every rank: {message}")

        return collectives.agree(problem, "plan", error, value=chosen)

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
    inputs: Callable[[], tuple | dict] | None = None,
    loss: Callable[..., torch.Tensor] | None = None,
    holds_output: bool = True,
    optimizer: OptimizerFactory | None = None,
    max_unsharded: int = 2,
    shard_size: int | None = None,
    backend: str | None = None,
    budget: int | str | None = None,
    placement: Placement | None = None,
    comm: Comm | str | None = None,
    progress: bool = False,
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
    ``model.cfg.seq_len``) passed as ``model(idx, targets)``; ``inputs()`` may return a dict
    instead, of keyword arguments (``input_ids=``, ``labels=`` for a Hugging Face model). The
    step's loss is ``loss(model, *inputs())`` where given (a loss computed outside the model,
    as most loops do: its temporaries count), else the model's output (its ``loss`` where it
    has one, as a Hugging Face output does), summed if it is not a scalar. ``inputs()`` and
    ``loss`` run under ``FakeTensorMode``: their tensors allocate nothing. holds_output:
    whether the training loop holds the model's output until the step ends (``logits =
    model(x)``, then the loss and backward: the default) or drops it before backward (a loss
    function's own frame, the HF Trainer, Lightning); with a large vocabulary the logits are
    among the step's largest tensors (Note [the loop's references]).
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
    its shard groups). The blocks alike of a model are moved together, and the step a budget
    first fits is refined to part of them (Note [blocks decided together] in budget.py).
    progress: a progress bar on stderr while the search runs, with the best peak so far
    (needs tqdm: ``pip install 'shardwise[tools]'``).

    It plans in this process, anywhere in a script, before or after ``shardwise.init()``: the
    fake world stands beside the run's own (Note [a world beside the real one] in groups.py),
    so the model, ``inputs`` and ``loss`` may be anything callable here, lambdas and
    ``__main__``'s functions included. Inside a run of several ranks it is collective: every
    rank calls it, rank 0 plans, and every rank gets that one plan (or its error).
    """
    build = _meta_factory(model)
    strategies, backend = _checked(
        world_size, strategy, shard_size, cpu_offload, budget, activation_checkpointing, backend
    )
    probe = build()
    micro_batch, shown = _micro_batch(probe, inputs, batch_size, seq_len)
    precision = MixedPrecision.of(mixed_precision)
    job = _Job(
        build=build,
        micro_batch=micro_batch,
        loss=loss,
        optimizer=optimizer or torch.optim.AdamW,
        precision=precision,
        precision_name=_precision_name(mixed_precision, precision),
        checkpointing=activation_checkpointing or wrap,
        max_unsharded=max_unsharded,
        shard_size=shard_size,
        placement=placement,
        comm=comm,
        holds_output=holds_output,
    )
    names = [u.name for u in select_units(probe, wrap)]
    if placement is None:  # (owned placement gives blocks different owners: not alike)
        job = dataclasses.replace(job, repeats=repeats_.find(probe, names))
    trained = sum(p.requires_grad for p in probe.parameters())
    step_check = theory(Sharding.FULL_SHARD, 0, world=world_size, b_gather=0, b_reduce=0, trained=trained)["step_check"]
    # (shardwise computes on the CPU under Gloo)
    planner = _Planner(job, one_memory=backend == "gloo", step_check=step_check)
    steps, dropped = [], []
    with groups.fake_world(world_size, backend), collectives.apart():
        if budget is None:
            estimates = [
                planner.run(_uniform(names, s, wrap, cpu_offload and s.shard), activation_checkpointing is not None)
                for s in strategies
            ]
        else:
            hybrid = strategies[0].hybrid
            steps, dropped = _budget_search(planner, probe, names, wrap, hybrid, world_size, backend, parse_bytes(budget), progress)
            estimates = [s.estimate for s in steps]
    n_params = sum(p.numel() for p in probe.parameters())
    title = (
        f"{n_params:,} parameters, {world_size} rank{'s' * (world_size > 1)} ({backend}), "
        f"micro-batch {shown} per rank, {job.precision_name}, optimizer {planner.optimizer_name}"
    )
    result = Plan(estimates, title, n_params, one_memory=planner.one_memory, path=steps, dropped=dropped)
    if budget is not None:
        result.budget = parse_bytes(budget)
        step, result.reason = search.choose(steps, result.budget, at=planner.rates.where)
        result.choice = step.estimate if step else None
    return result


def _budget_search(planner, probe, names, wrap, hybrid, world_size, backend, limit, progress):
    """The budget search's path and the units it dropped: blocks alike moved together, then
    the step that first fits refined (Note [blocks decided together] in budget.py)."""
    together = repeats_.together(probe, names)
    bar = _bar if progress else None
    steps, dropped = planner.search(together, wrap, hybrid, world_size, backend, limit, bar)
    if search.needs(steps[-1]) > limit and planner.job.repeats is None and len(together) < len(names):
        # (nothing fits with blocks moved together: a move per unit goes further, e.g.
        # the last block, whose backward comes first, recomputed where offloading its
        # activations saves nothing; a model planned whole is small enough for it)
        singles = [(n,) for n in names]
        steps, dropped = planner.search(singles, wrap, hybrid, world_size, backend, limit, bar)
    return planner.refine(steps, limit), dropped


def _bar(total: int):
    """The budget search's progress bar on stderr (tqdm, of the ``tools`` extra)."""
    try:
        from tqdm import tqdm
    except ImportError as exc:
        raise ShardwiseError("progress=True needs tqdm: pip install 'shardwise[tools]'") from exc
    return tqdm(total=total, desc="budget search", unit="plan", file=sys.stderr, disable=False)


def _checked(world_size, strategy, shard_size, cpu_offload, budget, activation_checkpointing, backend):
    """plan()'s options checked: the strategies to plan (typed) and the backend."""
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
    return strategies, backend


def _precision_name(given: MixedPrecision | str | None, precision: MixedPrecision) -> str:
    if isinstance(given, str):
        return given
    if precision.param_dtype or precision.reduce_dtype:
        return f"compute {precision.param_dtype}, reduce {precision.reduce_dtype}".replace("torch.", "")
    return "fp32"


class _Planner:
    """Plans configurations of one job in the fake world: one estimate per run (``run``), or
    the budget search's path (``search``)."""

    def __init__(self, job: _Job, *, one_memory: bool, step_check: int = 0):
        self.job, self.one_memory, self.optimizer_name = job, one_memory, ""
        self.step_check = step_check  # the whole model's (repeats.plan_alike)

    def run(self, settings: Settings, checkpointing: bool = False, profile=None) -> Estimate:
        repeats = self.job.repeats
        if repeats is not None and profile is None and repeats_.alike(settings, repeats):
            e = repeats_.plan_alike(
                lambda s, k: self._run(s, checkpointing, None, k), settings, repeats, self.step_check
            )
            if e is not None:
                return e
        return self._run(settings, checkpointing, profile)

    def _run(self, settings: Settings, checkpointing: bool, profile, blocks: int | None = None) -> Estimate:
        data, self.optimizer_name, shard_bytes, host = _run(self.job, settings, checkpointing, profile, blocks)
        return estimate_of(
            data, shard_bytes, settings, host, checkpointing=checkpointing,
            precision_name=self.job.precision_name, one_memory=self.one_memory,
        )

    def search(
        self, together: list[tuple[str, ...]], wrap, hybrid: bool, world: int, backend: str, budget: int,
        progress=None,
    ) -> tuple[list[search.Step], list[str]]:
        """The budget search's path over the units, in groups moved together, to the first
        step that fits ``budget`` (planner/budget.py); ``progress``: a progress bar's factory,
        or None."""
        names = [n for g in together for n in g]
        repeats = self.job.repeats

        def profile_of(settings: Settings) -> tuple[Estimate, search.Profile]:
            profile = search.Profile({}, {}, {}, {})
            if repeats is None:
                e = self.run(settings, profile=profile)
            else:  # (profiled on a few blocks: each block's figures are the first's)
                e = self.run(settings)
                self._run(repeats_.truncated(settings, repeats, repeats_.FEW), False, profile, repeats_.FEW)
                first, more = f"{repeats.path}.0", repeats.count - repeats_.FEW
                profile.forward_flops[""] = profile.forward_flops.get("", 0) + more * profile.forward_flops.get(first, 0)
                for n in repeats.names(repeats.count)[repeats_.FEW :]:
                    for figures in (profile.forward_flops, profile.saved_bytes):
                        if first in figures:
                            figures[n] = figures[first]
            for n, u in zip(names, e.units):
                profile.gathered_bytes[n], profile.shard_bytes[n] = u.gathered_bytes, u.shard_bytes
            return e, profile

        self.sharded = (
            (Sharding.HYBRID_SHARD_GRAD_OP, Sharding.HYBRID_SHARD)
            if hybrid
            else (Sharding.SHARD_GRAD_OP, Sharding.FULL_SHARD)
        )
        self.rates = measured_rates(backend, self.job.precision.param_dtype or torch.float32)
        steps, dropped, self.profile = search.path(
            together, wrap, self.sharded, self.run, profile_of, self.rates,
            world=world, offload=not self.one_memory, budget=budget, progress=progress,
        )
        return steps, dropped

    def refine(self, steps: list[search.Step], budget: int) -> list[search.Step]:
        """The path with the step a budget takes refined to part of its group's units
        (budget.refine). Each guess is a whole-model plan; where blocks alike make the path
        cheap (repeats.py), one guess only, as that plan costs what the path did."""
        return search.refine(
            steps, budget, self.run,
            lambda settings, e: search.seconds(settings, e.sent, self.profile, self.rates),
            self.sharded, tries=None if self.job.repeats is None else 1,
        )


def _uniform(names: list[str], strategy: Sharding, wrap: Policy | None, offload: bool) -> Settings:
    """One setting for every unit, as the strategy means it (``offload``: cpu_offload)."""
    keep = strategy.reshard_after_forward
    return Settings(
        strategy, wrap, tuple((n, UnitConfig(reshard_after_forward=keep and bool(n), offload=offload)) for n in names)
    )


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
