"""The planner: what each rank will hold and send, before launch and on no GPU.

    shardwise plan --model-size medium --world-size 8 --batch-size 8 --budget 24GiB
    shardwise.plan(lambda: GPT(cfg), world_size=8, batch_size=8, seq_len=256)

How it predicts, for one configuration:
1. The model is built on the meta device, then given fake CPU tensors (torch's
   ``FakeTensorMode``: shapes and dtypes, no memory), and its units are formed by the same
   functions ``shard()`` uses (``select_units``, ``assign_params``, ``layout_of``), so unit
   membership, padding and flat-buffer sizes are exact.
2. One micro-batch runs forward and backward on the fake model (in the compute dtype, with
   activation checkpointing applied if asked; operators pick the kernels a real device would,
   e.g. flash attention, which the meta device would not) under ``LiveBytes``, a dispatch
   mode that counts the storages operators create: after every operator it notes the bytes
   of activations and temporaries still alive, and hooks note where each unit's forward and
   backward begin and end and when its gradients are complete.
3. That timeline is replayed through the runtime's rules (gather on first use, prefetch of
   the next unit within ``max_unsharded``, reshard after forward for full_shard (but the
   unit that ran last) or after backward, one reduce per unit once its gradients are
   complete (resharding first if all its parameters train), each reduction finished before
   the next is issued, the last at the end of backward), adding at each moment the gathered
   buffers (and the gather's receive buffer while in flight), the unsharded gradients of
   units not yet reduced and the reduction buffers, on top of the shards and the optimizer
   state.
4. The optimizer named (AdamW by default) steps twice on meta shards of rank 0's shapes: its
   state is what the first step creates, its temporaries the peak of the second.
The predicted peak is the highest total of step 3 or of the optimizer step (gradients held,
state and temporaries). Steady state is assumed: gradients are freed (``zero_grad``) before
each forward and the optimizer state exists. CPU offload puts shards, gradients and
optimizer state (and the optimizer's step) in host memory, reported apart from the device.
"""

from __future__ import annotations

import argparse
import copy
import re
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._python_dispatch import TorchDispatchMode

from ..build import UnitPlan, assign_params, check_plans, layout_of, select_units
from ..checkpointing import checkpoint_activations
from ..errors import ShardwiseError
from ..policies import MixedPrecision
from ..runtime import _replace_tensors, _tensors
from ..wrap import Policy

STRATEGIES = ("full_shard", "shard_grad_op", "no_shard")
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class UnitRow:
    """One unit as every rank holds it (bytes per rank; the padded flat buffers)."""

    name: str
    params: int  # parameter elements, without padding
    shard_bytes: int
    gathered_bytes: int  # its full parameters in the compute dtype while gathered


@dataclass(frozen=True)
class Estimate:
    """The prediction for one configuration: bytes per rank (the largest rank's), per step."""

    strategy: str
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
    peak: int  # the device's predicted peak
    peak_at: str  # when it happens
    host: int  # host memory with cpu_offload (shards, gradients, state, the step's temporaries)
    comm: dict[str, int] = field(default_factory=dict)  # bytes sent per step, by collective

    @property
    def model_state(self) -> int:
        """Parameter shards, gradients and optimizer state: what a step leaves behind."""
        return self.param_shards + self.gradients + self.optimizer

    @property
    def sent(self) -> int:
        return sum(self.comm.values())

    @property
    def label(self) -> str:
        parts = [self.strategy + (" (DDP)" if self.strategy == "no_shard" else "")]
        if self.wrap != "-":
            parts.append(f"wrap {self.wrap}")
        if self.activation_checkpointing:
            parts.append("checkpointing")
        if self.cpu_offload:
            parts.append("offload")
        return ", ".join(parts)


@dataclass
class Plan:
    """Estimates side by side; with a budget, the cheapest that fits and why."""

    estimates: list[Estimate]
    title: str
    budget: int | None = None
    choice: Estimate | None = None
    reason: str = ""

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


def _to_fake(model: nn.Module) -> None:
    """Give the model fake CPU tensors (inside a ``FakeTensorMode``) in place of its meta
    ones: operators then pick the kernels a real device would (e.g. flash attention rather
    than the meta device's materialised attention scores), and allocate nothing."""
    swapped: dict[int, nn.Parameter] = {}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                if id(p) not in swapped:
                    swapped[id(p)] = nn.Parameter(
                        torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad
                    )
                m._parameters[name] = swapped[id(p)]
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = torch.zeros(b.shape, dtype=b.dtype)


class _Mark(torch.autograd.Function):
    """Identity on a unit's inputs whose backward says the unit's backward is done."""

    @staticmethod
    def forward(ctx, on_backward: Callable[[], None], *inputs: torch.Tensor):
        ctx.on_backward = on_backward
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.on_backward()
        return (None, *grads)


class LiveBytes(TorchDispatchMode):
    """Bytes held by the storages that operators allocate while active, per device type.

    A storage counts from the operator that created it (an output whose storage is not one of
    the operator's inputs) until it is freed; ``take_peak`` gives the highest ``live`` seen
    after any operator since the last call. Frees may come from other threads, so they are
    queued and folded in on the owning thread.
    """

    def __init__(self):
        super().__init__()
        # id(storage) -> (device type, bytes, weak reference whose callback books the free)
        self.sizes: dict[int, tuple[str, int, weakref.ref]] = {}
        self._freed: deque[tuple[str, int]] = deque()
        self._live: dict[str, int] = {}
        self._peak: dict[str, int] = {}

    def _on_free(self, key: int, _ref) -> None:
        entry = self.sizes.pop(key, None)
        if entry is not None:
            self._freed.append(entry[:2])

    def live(self) -> dict[str, int]:
        """Bytes of the storages allocated under this mode that are still alive."""
        while self._freed:
            dev, n = self._freed.popleft()
            self._live[dev] -= n
        return self._live

    def take_peak(self) -> dict[str, int]:
        """The peak since the last call, which restarts from the current total."""
        live = self.live()
        peak = {d: max(self._peak.get(d, 0), live.get(d, 0)) for d in set(live) | set(self._peak)}
        self._peak = {d: live.get(d, 0) for d in peak}
        return peak

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **kwargs) if kwargs else func(*args)
        inputs = None
        grew = False
        for t in _tensors(out, []):
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse, nested, ...: no plain storage
                continue
            key = id(st)
            if key in self.sizes:
                continue
            if inputs is None:
                inputs = {
                    id(a.untyped_storage())
                    for a in _tensors((args, kwargs), [])
                    if a.layout == torch.strided
                }
            if key in inputs:  # in place, out= or a view: no new memory
                continue
            dev, n = t.device.type, st.nbytes()
            self.sizes[key] = (dev, n, weakref.ref(st, partial(self._on_free, key)))
            self._live[dev] = self._live.get(dev, 0) + n
            grew = True
        if grew:
            for dev, n in self.live().items():
                if n > self._peak.get(dev, 0):
                    self._peak[dev] = n
        return out


class _Timeline(LiveBytes):
    """The meta run's record: bytes of activations and temporaries after every operator
    (``acts``) and the life-cycle moments of every unit (``events``: position, kind, unit,
    bytes), where a position is the number of operators run so far."""

    def __init__(self):
        super().__init__()
        self.acts: list[int] = []
        self.events: list[tuple[int, str, int, int]] = []
        self.grad_storage: dict[int, int] = {}  # id(storage) -> bytes of parameter gradients
        self.grad_total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.acts.append(self.live().get("cpu", 0) - self.grad_total)
        return out

    def note(self, kind: str, unit: int, nbytes: int = 0) -> None:
        self.events.append((len(self.acts), kind, unit, nbytes))

    def note_grad(self, unit: int, p: nn.Parameter) -> None:
        """A parameter's gradient is complete: count it as gradient, not activation."""
        st = p.grad.untyped_storage()
        if id(st) in self.grad_storage or id(st) not in self.sizes:
            return
        n = st.nbytes()
        self.grad_storage[id(st)] = n
        self.grad_total += n
        self.note("grad", unit, n)


@dataclass
class _Run:
    """What one meta forward and backward gives, shared by every strategy and world size."""

    plans: list[UnitPlan]
    masters: list[torch.dtype]  # each unit's storage dtype (the meta run computes in another)
    timeline: _Timeline
    forward_order: list[int]
    backward_order: list[int]
    seq_len: int | None = None  # of the default micro-batch
    optimizer_name: str = ""
    optimizer_bytes: dict[tuple[int, bool], tuple[int, int]] = field(default_factory=dict)


def _fake_run(
    build: Callable[[], nn.Module],
    wrap: Policy | None,
    checkpointing: Policy | None,
    precision: MixedPrecision,
    inputs: Callable[[], tuple] | None,
    batch_size: int,
    seq_len: int | None,
) -> _Run:
    """One forward and backward of a fake copy of the model, recorded (module doc, step 2)."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # imports sympy: only when planning

    fake = FakeTensorMode()
    model = build()
    with fake:
        _to_fake(model)
    plans = select_units(model, wrap)
    assign_params(model, plans)
    check_plans(model, plans)
    masters = [plan.params[0].dtype if plan.params else torch.float32 for plan in plans]
    if checkpointing is not None:
        checkpoint_activations(model, checkpointing)
    if precision.param_dtype is not None:
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(precision.param_dtype)
    tl = _Timeline()
    phase = {"backward": False}
    fwd: list[int] = []
    bwd: list[int] = []
    owner = {p: i for i, plan in enumerate(plans) for p in plan.params}
    trainable = [sum(p.requires_grad for p in plan.params) for plan in plans]
    ready = [0] * len(plans)
    handles = []

    def begin_backward(i: int) -> None:
        phase["backward"] = True
        bwd.append(i)
        tl.note("bwd_begin", i)

    for i, plan in enumerate(plans):

        def pre(module, args, kwargs, i=i):
            if phase["backward"]:  # recomputation under activation checkpointing
                return None
            tl.note("fwd_begin", i)
            fwd.append(i)
            flat = _tensors((args, kwargs), [])
            if torch.is_grad_enabled() and any(t.requires_grad for t in flat):
                marked = iter(_Mark.apply(lambda: tl.note("bwd_end", i), *flat))
                return _replace_tensors((args, kwargs), marked)
            return args, kwargs

        def post(module, args, output, i=i):
            if phase["backward"]:
                return
            tl.note("fwd_end", i)
            outs = [t for t in _tensors(output, []) if t.requires_grad]
            if outs:
                register_multi_grad_hook(outs, lambda _g, i=i: begin_backward(i), mode="any")

        handles.append(plan.module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
        handles.append(plan.module.register_forward_hook(post))

    def grad_ready(p: nn.Parameter) -> None:
        i = owner[p]
        tl.note_grad(i, p)
        ready[i] += 1
        if ready[i] == trainable[i]:
            tl.note("grads_ready", i)

    for p in owner:
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(grad_ready))
    try:
        with fake:
            if inputs is None:
                if seq_len is None:
                    seq_len = getattr(getattr(model, "cfg", None), "seq_len", None)
                if seq_len is None:
                    raise ShardwiseError(
                        "plan() needs seq_len= (or inputs=) to build a micro-batch for this model"
                    )
                tokens = torch.zeros(batch_size, seq_len, dtype=torch.long)
                args = (tokens, tokens)
            else:
                args = tuple(inputs())
            with tl:
                out = model(*args)
                loss = out if out.dim() == 0 else out.float().sum()
                loss.backward()
    finally:
        for h in handles:
            h.remove()
    tl.note("end", -1)
    return _Run(plans, masters, tl, fwd, bwd, seq_len)


def _optimizer_bytes(
    run: _Run, world: int, sharded: bool, factory: OptimizerFactory
) -> tuple[int, int]:
    """State and step temporaries of the optimizer on rank 0's shards (meta tensors)."""
    params = []
    for plan, master in zip(run.plans, run.masters):
        lay = layout_of(plan, world if sharded else 1)
        for slot, p in zip(lay.slots, plan.params):
            shard = torch.empty(slot.local_shape(0), dtype=master, device="meta")
            params.append(nn.Parameter(shard, requires_grad=p.requires_grad))
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        return 0, 0
    for p in trainable:
        p.grad = torch.empty_like(p)
    opt = factory(trainable)
    run.optimizer_name = type(opt).__name__
    opt.step()
    state = sum(
        v.numel() * v.element_size()
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )
    counter = LiveBytes()
    with counter:
        opt.step()
        temps = counter.take_peak().get("meta", 0)
    return state, temps


# --- replaying the meta run through the runtime's rules
@dataclass
class _Sizes:
    """Bytes of one unit's buffers for a strategy, world size and precision (per rank)."""

    gathered: int
    temp: int  # the gather's rank-major copy while in flight
    send: int  # the shard copied to the device / compute dtype before its gather
    shard: int
    packed: int  # the unsharded gradients laid out for the reduction
    cast: int  # no_shard: the bucket again in the reduction dtype, when it differs
    reduced: int  # the reduction's output: this rank's gradient shard (whole, for no_shard)
    grad_master: int  # the gradient shard in the master dtype, where it is a separate copy
    alias: bool = False  # one rank, no cast: the shard is the full buffer, nothing is reduced


def _sizes(
    plan: UnitPlan,
    world: int,
    sharded: bool,
    precision: MixedPrecision,
    offload: bool,
    master: torch.dtype,
) -> _Sizes:
    lay = layout_of(plan, world if sharded else 1)
    glay = lay.subset([p.requires_grad for p in plan.params])
    bm = master.itemsize
    compute, reduce = precision.compute_dtype(master), precision.reduction_dtype(master)
    bc, br = compute.itemsize, reduce.itemsize
    cast = compute != reduce
    if sharded:
        direct = not offload and compute == master
        if world == 1 and direct:
            return _Sizes(0, 0, 0, lay.shard_numel * bm, 0, 0, glay.shard_numel * bm, 0, alias=True)
        return _Sizes(
            gathered=lay.unsharded_numel * bc,
            temp=lay.unsharded_numel * bc if world > 1 else 0,
            send=0 if direct else lay.shard_numel * bc,
            shard=lay.shard_numel * bm,
            packed=glay.unsharded_numel * br,  # packed straight into the reduction dtype
            cast=0,
            reduced=glay.shard_numel * br,
            grad_master=glay.shard_numel * bm if (offload or reduce != master) else 0,
        )
    return _Sizes(
        gathered=lay.numel * bc if compute != master else 0,  # the compute copy
        temp=0,
        send=0,
        shard=lay.numel * bm,
        packed=glay.numel * bc,
        cast=glay.numel * br if cast else 0,
        reduced=glay.numel * br,
        grad_master=glay.numel * bm if reduce != master else 0,
    )


def _simulate(
    run: _Run,
    strategy: str,
    world: int,
    precision: MixedPrecision,
    offload: bool,
    max_unsharded: int,
) -> dict:
    """Device bytes over the meta run's timeline under the runtime's rules (module doc, 3),
    on top of what persists (shards, optimizer state): the peak and where it happens."""
    plans = run.plans
    n, root = len(plans), len(plans) - 1
    sharded = strategy != "no_shard"
    size = [_sizes(p, world, sharded, precision, offload, m) for p, m in zip(plans, run.masters)]
    state = ["S"] * n if sharded else ["U"] * n  # S sharded, G gathering, U unsharded
    reduced = [False] * n
    unreduced = [0] * n  # bytes of a unit's unsharded gradients before its reduction
    inflight = [0] * n  # a reduction's laid-out input, held until the next one is issued
    reducing: list[int | None] = [None]  # the unit reduced last
    gathers = [0] * n
    # no_shard keeps whole parameters (counted as persistent) and, if cast, compute copies
    m = {"gathered": 0 if sharded else sum(s.gathered for s in size), "grads": 0}
    # no_shard without casts keeps one gradient bucket per unit for good (as DDP does)
    kept_bucket = [not sharded and not s.gathered and not s.cast for s in size]
    m["grads"] = sum(s.packed for s, kept in zip(size, kept_bucket) if kept)
    nxt_f, nxt_b = _successors(run.forward_order), _successors(run.backward_order)
    last_forward = next((i for i in reversed(run.forward_order) if i != root), None)
    all_train = [all(p.requires_grad for p in plan.params) for plan in plans]

    def unshard(i: int) -> None:
        """Issue: the gather's buffers; the full buffer too with one rank (there is no copy-out)."""
        if state[i] == "S":
            state[i] = "G"
            gathers[i] += 1
            s = size[i]
            m["gathered"] += s.temp + s.send + (0 if s.temp else s.gathered)

    def wait(i: int) -> None:
        """Wait: the full buffer is allocated for the copy-out, then the gather's buffers go."""
        unshard(i)
        if state[i] == "G":
            state[i] = "U"
            s = size[i]
            if s.temp:
                m["gathered"] += s.gathered
                consider(now())
            m["gathered"] -= s.temp + s.send

    def reshard(i: int) -> None:
        if state[i] == "G":
            wait(i)
        if state[i] == "U":
            state[i] = "S"
            m["gathered"] -= size[i].gathered

    def prefetch(i: int | None) -> None:
        if i is None or state[i] != "S":
            return
        if strategy == "full_shard":
            if sum(s != "S" for j, s in enumerate(state) if j != root) >= max_unsharded:
                return
        elif "G" in state:
            return
        unshard(i)

    def reduce(i: int, done: bool) -> None:
        """Issue unit i's reduction, noting the moment its buffers are laid out; a unit whose
        backward is ``done`` reshards first."""
        if reduced[i]:
            return
        reduced[i] = True
        if sharded and done and i != root:
            reshard(i)
        s = size[i]
        if s.alias:  # the unsharded gradients become the shard's
            unreduced[i] = 0
            return
        bucket = s.cast or s.packed
        if sharded:
            # the rows and the output are allocated, the gradients packed into them in the
            # reduction dtype, then the unsharded gradients go; the output shard stays and the
            # rows until the collective completes (with one rank, the one row is the output)
            if reducing[0] is not None:  # the previous reduction is finished first
                inflight[reducing[0]] = 0
            reducing[0] = i
            out = s.reduced if world > 1 else 0
            consider(now() + s.packed + out)
            m["grads"] += s.reduced - unreduced[i]
            inflight[i] = bucket if world > 1 else 0
        else:
            if kept_bucket[i]:  # copied into the bucket, whose views replace them
                consider(now())
                m["grads"] -= unreduced[i]
            else:  # a bucket to the end; the compute copies' gradients go
                consider(now() + s.packed + s.cast)
                m["grads"] += bucket - (unreduced[i] if s.gathered else 0)
        unreduced[i] = 0

    def finish() -> None:
        """End of backward: every gradient lands on its shard in the master dtype."""
        for i, s in enumerate(size):
            if not reduced[i]:
                continue
            if s.alias:
                pass
            elif sharded and offload:  # copied to host memory
                m["grads"] -= s.reduced
            elif sharded and s.grad_master:  # cast into a copy in the master dtype
                m["grads"] += s.grad_master - s.reduced
            elif not sharded and not s.gathered and s.cast:  # copied into the parameters' own
                m["grads"] -= s.cast or s.packed
            elif not sharded and s.grad_master:
                m["grads"] += s.grad_master - (s.cast or s.packed)
            inflight[i] = 0

    acts = run.timeline.acts
    best = {"peak": 0, "at": "", "gathered": m["gathered"]}
    cur = {"act": 0, "where": "start of forward"}

    def now() -> int:
        return m["gathered"] + m["grads"] + sum(inflight) + cur["act"]

    def consider(total: int) -> None:
        best["gathered"] = max(best["gathered"], m["gathered"])
        if total > best["peak"]:
            best["peak"], best["at"] = total, cur["where"]

    events = run.timeline.events
    k = 0
    for pos in range(len(acts) + 1):
        cur["act"] = acts[pos - 1] if pos else 0
        while k < len(events) and events[k][0] == pos:
            _, kind, i, nbytes = events[k]
            k += 1
            name = (plans[i].name or "<root>") if i >= 0 else ""
            if kind == "fwd_begin":
                cur["where"] = f"forward of {name}"
                if sharded:
                    if i == root:  # the next gather goes out before the root's wait
                        unshard(i)
                        prefetch(nxt_f.get(i))
                    wait(i)
                    prefetch(nxt_f.get(i))
            elif kind == "fwd_end":
                if strategy == "full_shard" and i not in (root, last_forward):
                    reshard(i)
            elif kind == "bwd_begin":
                cur["where"] = f"backward of {name}"
                if sharded:
                    wait(i)
                    prefetch(nxt_b.get(i))
            elif kind == "grad" and not reduced[i]:
                unreduced[i] += nbytes
                m["grads"] += nbytes
            elif kind == "grads_ready":
                reduce(i, all_train[i])
            elif kind == "bwd_end":
                reduce(i, True)
                consider(now())
                if sharded and i != root:
                    reshard(i)
            elif kind == "end":
                cur["where"] = "end of backward"
                ran = set(run.forward_order)
                for j in range(n):
                    if j in ran or unreduced[j]:
                        reduce(j, True)
                consider(now())
                finish()
                if sharded:
                    for j in range(n):
                        reshard(j)
            consider(now())
        consider(now())
    return {
        "peak": best["peak"],
        "at": best["at"],
        "gathered_peak": best["gathered"],
        "activations": max(acts, default=0),
        "gathers": gathers,
        "sizes": size,
    }


def _successors(order: list[int]) -> dict[int, int]:
    nxt: dict[int, int] = {}
    for a, b in zip(order, order[1:]):
        if a != b:
            nxt.setdefault(a, b)
    return nxt


def _comm(
    sim: dict,
    plans: list[UnitPlan],
    masters: list[torch.dtype],
    strategy: str,
    world: int,
    precision: MixedPrecision,
) -> dict[str, int]:
    """Bytes each rank sends per step, booked as ``shardwise.comm_stats`` books them."""
    out = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    if world == 1:
        return out
    for plan, master, s, gathers in zip(plans, masters, sim["sizes"], sim["gathers"]):
        if not any(p.requires_grad for p in plan.params) and strategy == "no_shard":
            continue
        br = precision.reduction_dtype(master).itemsize
        if strategy == "no_shard":
            numel = sum(p.numel() for p in plan.params if p.requires_grad)
            out["all_reduce"] += 2 * (numel * br) * (world - 1) // world
        else:
            out["all_gather"] += gathers * (s.gathered * (world - 1) // world)
            if any(p.requires_grad for p in plan.params):
                out["reduce_scatter"] += s.packed * (world - 1) // world
    return out


def _estimate(
    run: _Run,
    *,
    strategy: str,
    world_size: int,
    precision: MixedPrecision,
    precision_name: str,
    cpu_offload: bool,
    checkpointing: bool,
    wrap_name: str,
    optimizer: OptimizerFactory,
    max_unsharded: int,
) -> Estimate:
    """The prediction for one configuration from a meta run (see the module doc)."""
    if cpu_offload and strategy == "no_shard":
        raise ShardwiseError("cpu_offload needs a sharded strategy (full_shard or shard_grad_op)")
    sharded = strategy != "no_shard"
    sim = _simulate(run, strategy, world_size, precision, cpu_offload, max_unsharded)
    sizes = sim["sizes"]
    key = (world_size, sharded)
    if key not in run.optimizer_bytes:
        run.optimizer_bytes[key] = _optimizer_bytes(run, world_size, sharded, optimizer)
    state, temps = run.optimizer_bytes[key]
    shards = sum(s.shard for s in sizes)
    copies = sum(s.gathered for s in sizes) if not sharded else 0
    grads = sum(s.grad_master or s.reduced for s in sizes)
    persistent_dev = 0 if cpu_offload else shards + state  # the replay holds the compute copies
    fwd_bwd = persistent_dev + sim["peak"]
    # the optimizer's step: gradients held, state and temporaries (on the host when offloaded)
    step = shards + grads + state + temps
    if cpu_offload:
        peak, at = fwd_bwd, sim["at"]
        host = step
    else:
        peak, at = (
            (fwd_bwd, sim["at"]) if fwd_bwd >= step + copies else (step + copies, "optimizer step")
        )
        host = 0
    units = tuple(
        UnitRow(
            plan.name or "<root>",
            sum(p.numel() for p in plan.params),
            s.shard,
            s.gathered if sharded else 0,
        )
        for plan, s in zip(run.plans, sizes)
    )
    return Estimate(
        strategy=strategy,
        wrap=wrap_name if sharded else "-",
        world_size=world_size,
        mixed_precision=precision_name,
        cpu_offload=cpu_offload,
        activation_checkpointing=checkpointing,
        units=units,
        param_shards=shards,
        gradients=grads,
        optimizer=state,
        gathered_peak=sim["gathered_peak"] if sharded else copies,
        activations=sim["activations"],
        peak=peak,
        peak_at=at,
        host=host,
        comm=_comm(sim, run.plans, run.masters, strategy, world_size, precision),
    )


# --- the public function
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
    optimizer: OptimizerFactory | None = None,
    max_unsharded: int = 2,
    budget: int | str | None = None,
) -> Plan:
    """Predict each rank's memory and traffic for a training step, without building the model
    for real (see the module doc for how).

    model: an ``nn.Module`` (copied with fake tensors, never touched) or a function that
    builds one (called under ``torch.device("meta")``). strategy: one, several, or None for
    all three side by side (no_shard is DDP's layout). wrap, mixed_precision, cpu_offload and
    max_unsharded mean what they mean for ``shard()``; activation_checkpointing is the policy
    ``checkpoint_activations`` would get. The micro-batch is ``inputs()`` (positional
    arguments) or, by default, token ids of ``batch_size`` x
    ``seq_len`` (default: ``model.cfg.seq_len``) passed as ``model(idx, targets)``; a
    non-scalar output is summed into a loss. ``inputs()`` runs under the planner's
    ``FakeTensorMode``, so its tensors allocate nothing.
    optimizer: a function of the parameters that builds it (default ``torch.optim.AdamW``).

    budget: bytes or a string such as "24GiB": the configurations tried are every strategy,
    wrap None and ``wrap``, activation checkpointing off and on (with
    ``activation_checkpointing``, else the wrap policy) and offload off and on; the choice is
    the first whose device peak fits, in order of cost (see ``COST_ORDER``).
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
    factory = optimizer or (lambda params: torch.optim.AdamW(params))
    if world_size < 1:
        raise ShardwiseError(f"world_size={world_size} must be at least 1")
    strategies = (
        STRATEGIES
        if strategy is None
        else (strategy,)
        if isinstance(strategy, str)
        else tuple(strategy)
    )
    for s in strategies:
        if s not in STRATEGIES:
            raise ShardwiseError(f"strategy={s!r} is not one of {STRATEGIES}")
    if cpu_offload and strategy is not None and "no_shard" in strategies:
        raise ShardwiseError(
            "cpu_offload=True needs a sharded strategy: with no_shard every rank keeps whole "
            "parameters on the device anyway. Use strategy='full_shard' or 'shard_grad_op'."
        )
    ckpt_policy = activation_checkpointing or wrap
    runs: dict[tuple[int, bool], _Run] = {}  # (id of the wrap policy, checkpointing) -> run

    def run_for(w: Policy | None, ckpt: bool) -> _Run:
        key = (id(w), ckpt)
        if key not in runs:
            runs[key] = _fake_run(
                build, w, ckpt_policy if ckpt else None, precision, inputs, batch_size, seq_len
            )
        return runs[key]

    if budget is None:  # DDP, for comparison, holds everything on the device
        configs = [
            (s, wrap, activation_checkpointing is not None, cpu_offload and s != "no_shard")
            for s in strategies
        ]
    else:
        configs = [
            (s, w, ckpt, off)
            for s in STRATEGIES
            for w in ([None] if s == "no_shard" else dict.fromkeys([None, wrap]))
            for ckpt in ([False, True] if ckpt_policy else [False])
            for off in ([False] if s == "no_shard" else [False, True])
        ]
    estimates = [
        _estimate(
            run_for(w, ckpt),
            strategy=s,
            world_size=world_size,
            precision=precision,
            precision_name=precision_name,
            cpu_offload=off,
            checkpointing=ckpt,
            wrap_name=_policy_name(w),
            optimizer=factory,
            max_unsharded=max_unsharded,
        )
        for s, w, ckpt, off in configs
    ]
    first = next(iter(runs.values()))
    n_params = sum(p.numel() for plan_ in first.plans for p in plan_.params)
    tokens = f"{batch_size} x {first.seq_len}" if inputs is None else "inputs()"
    title = (
        f"{n_params:,} parameters, {world_size} rank{'s' * (world_size > 1)}, micro-batch {tokens} "
        f"per rank, {precision_name}, optimizer {first.optimizer_name}"
    )
    result = Plan(estimates, title)
    if budget is not None:
        result.budget = parse_bytes(budget)
        result.choice, result.reason = choose(estimates, result.budget)
    return result


def _policy_name(policy: Policy | None) -> str:
    return "none" if policy is None else repr(policy)


SIMPLEST_FIRST = ("no_shard", "shard_grad_op", "full_shard")
COST_ORDER = (
    "no offload before offload (host transfers every step), no checkpointing before "
    "checkpointing (a third more compute), fewer bytes sent per step, no_shard before "
    "shard_grad_op before full_shard, then fewer units (fewer, larger collectives)"
)


def choose(estimates: list[Estimate], budget: int) -> tuple[Estimate | None, str]:
    """The first estimate that fits ``budget`` in ``COST_ORDER``, and a sentence saying why."""
    unit = max(1, max(e.sent for e in estimates) // 100)  # traffic compared to 1%: equal is equal
    order = sorted(
        estimates,
        key=lambda e: (
            e.cpu_offload,
            e.activation_checkpointing,
            round(e.sent / unit),
            SIMPLEST_FIRST.index(e.strategy),
            len(e.units),
        ),
    )
    cheaper = []
    for e in order:
        if e.peak <= budget:
            share = f"{100 * e.peak / budget:.0f}%"
            why = f"{e.label} fits: predicted peak {_fmt(e.peak)} of {_fmt(budget)} ({share})"
            if cheaper:
                misses = "; ".join(f"{c.label} needs {_fmt(c.peak)}" for c in cheaper[:4])
                why += f". Cheaper configurations do not fit: {misses}"
            return e, why + f". Order of cost: {COST_ORDER}."
        cheaper.append(e)
    best = min(estimates, key=lambda e: e.peak)
    return None, (
        f"nothing fits {_fmt(budget)}: the smallest peak is {_fmt(best.peak)} ({best.label}). "
        "Lower the micro-batch, use more ranks, or use mixed precision."
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
        if e.strategy != "no_shard":
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
        ("predicted peak (device)", lambda e: e.peak),
        ("host (cpu offload)", lambda e: e.host),
        ("sent per step: all-gather", lambda e: e.comm["all_gather"]),
        ("  reduce-scatter", lambda e: e.comm["reduce_scatter"]),
        ("  all-reduce", lambda e: e.comm["all_reduce"]),
    ]
    for start in range(0, len(cols), 4):
        chunk = cols[start : start + 4]
        lines.append(f"{'per rank, MiB':<27}" + "".join(f"{_short(e):>26}" for e in chunk))
        for name, get in rows:
            lines.append(f"  {name:<25}" + "".join(f"{_mib(get(e)):>26}" for e in chunk))
        lines.append(f"  {'peak happens at':<25}" + "".join(f"{e.peak_at[:25]:>26}" for e in chunk))
        lines.append("")
    if any(c.wrap == "none" or c.activation_checkpointing or c.cpu_offload for c in cols):
        lines.append("columns: +root = no wrap (one unit), +ac = checkpointing, +off = cpu offload")
    if e0.world_size > 1:
        lines.append(
            "ranks hold equal padded buffers; rank 0 the most optimizer state (most rows)."
        )
    if p.budget is not None:
        lines.append(f"budget {_fmt(p.budget)}: " + ("choose " if p.choice else "") + p.reason)
    return "\n".join(lines)


def _short(e: Estimate) -> str:
    """A column header: the strategy, then +root (wrap none), +ac (checkpointing), +off."""
    name = "no_shard (DDP)" if e.strategy == "no_shard" else e.strategy
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
        "--strategy", choices=STRATEGIES, help="one strategy (default: all side by side)"
    )
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
        "--budget",
        help="device memory per rank, e.g. 24GiB: pick the cheapest configuration that fits",
    )
    a = ap.parse_args(argv)
    cfg = gpt_config(a.model_size, seq_len=a.seq_len)
    wrap = {"block": by_class(Block), "size": by_size(1_000_000), "none": None}[a.wrap]
    result = plan(
        lambda: GPT(cfg),
        world_size=a.world_size,
        strategy=a.strategy,
        wrap=wrap,
        mixed_precision=None if a.mixed_precision == "none" else a.mixed_precision,
        cpu_offload=a.cpu_offload,
        activation_checkpointing=by_class(Block) if a.activation_checkpointing else None,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        budget=a.budget,
    )
    print(f"GPT {a.model_size}: " + str(result))
