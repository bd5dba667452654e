"""The hooks that drive every unit's life cycle, the execution order, prefetch, and the
end-of-backward callback. One ``Runtime`` per sharded model.

Forward: a unit's pre-forward hook waits for (or issues) its gather and issues the prefetch of
the unit that ran next on the previous iteration; its post-forward hook reshards (a unit that
reshards after forward: full_shard's, or as a plan's ``UnitConfig`` says; never the root) and
registers the pre-backward hook on the unit's outputs. Backward: the
pre-backward hook gathers again and prefetches in backward order; a hook on views of the
unit's inputs (made in pre-forward) marks the end of its backward, where it reshards and issues its
reduce-scatter (Note [when a unit reduces]), while earlier layers still compute, after
finishing the one issued before; which of its parameters got a gradient is which full
parameters hold one then. A replicated unit has no such hooks: a post-accumulate-grad hook on
each of its parameters notes which got a gradient, and reduces in order (like DDP's buckets).
The final callback issues
what is left, waits for every reduction, agrees with the other ranks on which parameters got
a gradient anywhere (those that got none keep their ``.grad``, as in one process) and
leaves ``.grad`` on the shards.
"""

from __future__ import annotations

import inspect
import itertools
import sys
import weakref
from collections.abc import Callable
from enum import Enum, auto

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook

from . import buckets, events
from . import collectives as C
from .errors import ShardwiseError
from .groups import Mesh
from .policies import Comm, MixedPrecision, Sharding
from .replica_groups import ReplicaGroups
from .unit import Occupancy, ReplicatedUnit, ShardedUnit, Unit, UnitState


class Phase(Enum):
    IDLE = auto()
    FORWARD = auto()
    BACKWARD = auto()


def flat_tensors(obj, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors inside nested tuples, lists and dicts, in order."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            flat_tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            flat_tensors(o, out)
    return out


def _replace_tensors(obj, it):
    """``obj`` with each tensor (in ``flat_tensors`` order) replaced by the next item of ``it``."""
    if isinstance(obj, torch.Tensor):
        return next(it)
    if isinstance(obj, (tuple, list)) and not hasattr(obj, "_fields"):
        return type(obj)(_replace_tensors(o, it) for o in obj)
    if isinstance(obj, tuple):  # namedtuple
        return type(obj)(*(_replace_tensors(o, it) for o in obj))
    if isinstance(obj, dict):
        return {k: _replace_tensors(v, it) for k, v in obj.items()}
    return obj


# Note [weak references from C++]: what autograd holds from C++ (hooks on parameters and
# graph nodes, a custom function's ctx) is invisible to Python's collector. A strong reference
# from there to the runtime or a unit, which both lead back to the parameters, would keep the
# whole model alive forever whenever the holder outlives the step: a parameter always does,
# and graph nodes do when a tool's hook holds its own nodes (torch's
# register_multi_grad_hook(mode="all"), used by MemTracker's ModTracker, makes such a cycle).
# So all of them reach the runtime and the unit through weak references.


# Note [compile]: a unit's hooks gather and free its parameters, swap them in its modules
# and issue collectives; none of that belongs in a compiled graph. So every hook runs
# eagerly, outside dynamo (as FSDP2's do): compiling a wrapped block compiles its forward
# alone, called between its pre- and post-forward hooks, when the module already holds the
# full parameters, which are the same tensors every step (no recompilation). Compiling the
# whole model leaves each unit's hooks as graph breaks between compiled regions.
_DISABLE_REASON = (
    "shardwise's hooks gather and free a unit's parameters outside compiled graphs: compile "
    "each wrapped block (block.compile()), or the whole model without fullgraph=True"
)
_DISABLE_KW = {"reason": _DISABLE_REASON} if "reason" in inspect.signature(torch.compiler.disable).parameters else {}


def _outside_graphs(fn):
    """``fn`` always runs eagerly, never traced into a torch.compile graph (Note [compile])."""
    return torch.compiler.disable(fn, recursive=True, **_DISABLE_KW)


def _in_backward() -> bool:
    """Whether this thread is running a backward (the private call FSDP2 uses too: torch has
    no public one)."""
    return torch._C._current_graph_task_id() != -1


# Note [a step that raised]: an exception in forward or in backward, raised alike on every
# rank and caught by the training loop, leaves a step half done: units gathered or gathering,
# reductions and the step check in flight, gradients on the full parameters, this step's
# counts. When backward raises, autograd drops the queued end-of-backward callback with it, so
# nothing clears that state, and the next backward would not even queue its own
# (``callback_queued`` stays set). So ``step_abandoned`` tells when the last step raised: the
# root's forward raised (an always-called forward hook sees no output), or our callback was
# queued and never ran and the backward that held it is over (we are outside any backward, or
# autograd no longer holds it). Every hook that starts a step or a backward checks it first (a
# unit's pre-forward, the pre-backward, and the gradient hooks, which are all that a plain
# no_shard model has), and so do the functions that need a step's end (full_state_dict, ...);
# ``reset`` then clears the step. It *waits* for the collectives in flight rather than
# dropping them (every rank issued them alike, and unread Gloo messages would meet the next
# step's of the same tag), discards their results and the gradients not yet on the shards
# (no_sync's accumulation included, as the caller's zero_grad discards those on the shards;
# a unit that computes on its shard parameters, ``shared``, has none: as in one process, the
# failed step's are on the shards already), and reshards every unit: the next step runs as
# if the failed one had not started. The step check's digest keeps the failed step's
# collectives: every rank issued the same ones, so the digests still agree; a rank that
# failed alone waits in a collective its peers never issue, or they in one it never issues,
# and each ends with a CollectiveError.
# A loss that raises outside the model, after a forward that completed, cannot be told from a
# forward whose backward comes later (two forwards, one loss): nothing is reset. Its state is
# harmless (units are gathered again or resharded as usual, the stale count only defers
# reductions to the end of the next backward), except gradients accumulated under no_sync in
# shardwise's hands (sharded units, casting no_shard units): ``shardwise.reset`` is for that.


def _check_not_compiled_autograd() -> None:
    """Compiled autograd would trace the backward hooks that gather parameters and issue
    collectives into its graph (Note [compile]): refuse it up front."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    config = sys.modules.get("torch._dynamo.config")
    if getattr(config, "compiled_autograd", False) or getattr(ca, "compiled_autograd_enabled", False):
        raise ShardwiseError(
            "compiled autograd is on (torch._dynamo.config.compiled_autograd), but shardwise's "
            "backward hooks gather parameters and reduce gradients outside compiled graphs. "
            "Turn compiled autograd off; torch.compile of the blocks or the model still "
            "compiles their backward (AOTAutograd)."
        )


def _on_gradient(t: torch.Tensor, hook) -> None:
    """Call ``hook`` when ``t``'s gradient is about to flow back: a pre-hook on the node that
    made it (which runs when a hook on the tensor would, and costs less to register and call),
    or a hook on the tensor where it is a leaf."""
    if t.grad_fn is not None:
        t.grad_fn.register_prehook(hook)
    else:
        t.register_hook(hook)


def _post_backward_hook(runtime_ref: weakref.ref, unit_ref: weakref.ref):
    """The hook on views of a unit's inputs that runs once the unit's own backward is done:
    the views' gradients are complete when every use of them inside the unit has given its
    part (Note [weak references from C++]). A view and a pre-hook on its node cost less than
    an autograd function on the inputs, which did the same."""

    def hook(_grads) -> None:
        runtime, unit = runtime_ref(), unit_ref()
        if runtime is not None and unit is not None:
            runtime.post_backward(unit)

    return hook


def _pre_backward_hook(runtime_ref: weakref.ref, unit_ref: weakref.ref):
    """The hook on a unit's outputs that starts its backward (Note [weak references from C++])."""

    @_outside_graphs
    def hook(_grad) -> None:
        runtime, unit = runtime_ref(), unit_ref()
        if runtime is not None and unit is not None:
            runtime._pre_backward(unit)

    return hook


class Runtime:
    """Hook state of one sharded model: its units, phase, recorded orders and options."""

    def __init__(
        self,
        root: nn.Module,
        units: list[Unit],
        sharding: Sharding,
        mesh: Mesh,
        max_unsharded: int,
        precision: MixedPrecision,
        host_group,
        comm: Comm,
        replica_groups: ReplicaGroups | None = None,
    ):
        self.root = root
        self.precision = precision
        self.comm = comm  # precision on the wire, for tools (the units apply it)
        self.grad_scaler = None  # a shardwise.GradScaler attaches itself here
        self.units = units  # innermost first, root last
        self.sharding = sharding  # the strategy (its name, for tools and checkpoints, is its value)
        self.mesh = mesh
        self.replica_groups = replica_groups  # replica groups outside the job (replica_groups.py), whose units reduce across them
        # all-reduces that follow a unit's reduce-scatter: one unit's reduction in flight per each
        self._all_reduces_after_scatter = int(sharding.hybrid) + int(replica_groups is not None)
        self.max_unsharded = max_unsharded
        self.sync_grads = True
        self.phase = Phase.IDLE
        self.callback_queued = False
        self._callback: Callable[[], Callable | None] = lambda: None  # weak: autograd holds it
        self.agreeing: Callable[[], list[bool]] | None = None  # the step check in flight
        self.forward_raised = False  # the root's forward raised (Note [a step that raised])
        self.forward_order: list[Unit] = []  # this iteration's order of pre-forward hooks
        self.backward_order: list[Unit] = []  # and of pre-backward hooks
        self.next_forward: dict[Unit, Unit] = {}  # last iteration's successor of each unit
        self.next_backward: dict[Unit, Unit] = {}
        self.reducing: list[ShardedUnit] = []  # sharded units whose reductions are in flight
        self.unfinished: set[Unit] = set()  # units whose reduction was issued and not finished
        self.ran_once: set[Unit] = set()
        self.peak_unsharded = 0  # most non-root units (a bucket counting once) unsharded or gathering at once
        self._tracks_peak = any(u.reshard_after_forward and not u.one_rank for u in units if not u.is_root)
        self.occupancy = Occupancy()
        for u in units:
            if isinstance(u, ShardedUnit):
                u.count_in(self.occupancy)
        # Note [when a unit reduces]: ranks must issue untagged collectives in one order, and
        # which parameters get a gradient may differ between ranks (data-dependent models), so
        # no reduction waits on "every gradient is in". A sharded unit reduces when the last
        # backward of this step's forward calls of it ends (``post_backward``), else at the
        # end of backward. Replicated units have no gathers to keep in step with: they reduce
        # in one fixed order (reverse module order), each as soon as it and those before it
        # have all their gradients, the rest at the end of backward (DDP's bucket order).
        self.reduce_order = _reverse_module_order(root, [u for u in units if isinstance(u, ReplicatedUnit)])
        self.next_in_order = 0  # position in reduce_order of the next reduction to issue
        self.pending_backwards: dict[Unit, int] = {}  # forward calls whose backward has not ended
        self.ran_since_sync: set[Unit] = set()
        self.host_group = host_group  # the side group of the step check (collectives.step_check)
        self.activations = None  # an activation_offload.Offload where a unit offloads its activations
        self.check_buffer: torch.Tensor | None = None
        self.bucket_bytes = buckets.BUCKET_BYTES  # 0: every unit alone
        self.buckets: list[buckets.Bucket] = []  # decided from the forward order of the last step
        self._bucketed_by: tuple = ([], self.bucket_bytes)  # ... which was this, with this limit
        self._bucketable = sum(isinstance(u, ShardedUnit) and buckets.key(u) is not None for u in units) > 1
        self._ref = weakref.ref(self)  # what autograd holds (Note [weak references from C++])
        for unit in units:
            self._register(unit)

    # --- registration
    def _register(self, unit: Unit) -> None:
        m = unit.module
        unit_ref = weakref.ref(unit)
        if isinstance(unit, ShardedUnit) or unit.casts:  # plain no_shard needs none, like DDP
            m.register_forward_pre_hook(self._make_pre_forward(unit, unit_ref), with_kwargs=True)
            m.register_forward_hook(self._make_post_forward(unit, unit_ref))
            if unit.is_root:
                m.register_forward_hook(self._note_forward_raised, always_call=True)
        if isinstance(unit, ShardedUnit):  # notes which parameters got a gradient as it reduces
            return
        trainable = [p for p in unit.full_params if p.requires_grad]
        for j, p in enumerate(trainable):
            p.register_post_accumulate_grad_hook(self._make_grad_ready(unit_ref, j))

    # --- forward
    def _make_pre_forward(self, unit: Unit, unit_ref: weakref.ref):
        post_backward = _post_backward_hook(self._ref, unit_ref)

        @_outside_graphs
        def hook(module, args, kwargs):
            if (self.forward_raised or self.callback_queued) and self.step_abandoned():
                self.reset()
            if self.phase is Phase.BACKWARD:  # recomputation (activation checkpointing)
                unit.wait_unshard()
                return None
            cast = False  # (the root's floating-point inputs, cast to the compute dtype)
            if unit.is_root:
                if torch.is_grad_enabled():
                    _check_not_compiled_autograd()
                self.phase = Phase.FORWARD
                self.forward_order = []
                self._expose_shards(False)
                if self.precision.param_dtype is not None:
                    args, kwargs = _cast_floats((args, kwargs), self.precision.param_dtype)
                    self._check_loss_scaling()
                    cast = True
                # activations are few yet: the next gather goes out before the wait
                unit.unshard()
                self._prefetch(self.next_forward.get(unit))
            unit.wait_unshard()
            if events.listeners:
                events.emit("forward", unit.label, edge="begin")
            self.forward_order.append(unit)
            nxt = self.next_forward.get(unit)
            if nxt is not None and nxt.state is UnitState.SHARDED and not nxt.one_rank:
                self._prefetch(nxt)
            if self._tracks_peak and self.occupancy.unsharded > self.peak_unsharded:
                self.peak_unsharded = self.occupancy.unsharded
            # a unit computing on its shard parameters has nothing to do when its backward
            # ends (its gradients land where one process's would): that end is marked only
            # to show it
            if torch.is_grad_enabled() and (not unit.shared or events.listeners):
                # every call counts; one whose inputs need no gradient has no end of backward
                # that could be seen, so its unit reduces at the end of backward (a unit
                # called again later would otherwise reduce after its last call's backward,
                # before its first call's gradients are in: they were lost)
                self.pending_backwards[unit] = self.pending_backwards.get(unit, 0) + 1
                if len(args) == 1 and not kwargs and type(args[0]) is torch.Tensor:  # (the usual call)
                    x = args[0]
                    if not x.requires_grad:
                        return (args, kwargs) if cast else None
                    view = x.view_as(x)
                    view.grad_fn.register_prehook(post_backward)
                    return (view,), kwargs
                plain = not kwargs and all(type(a) is torch.Tensor or type(a) is nn.Parameter for a in args)
                flat = args if plain else flat_tensors((args, kwargs), [])
                marked = [t.view_as(t) if t.requires_grad else t for t in flat]
                views = [v for v, t in zip(marked, flat) if v is not t]
                if len(views) == 1:  # (what register_multi_grad_hook does for one, without its wrapping)
                    views[0].grad_fn.register_prehook(post_backward)
                elif views:
                    register_multi_grad_hook(views, post_backward, mode="all")
                if views:
                    return (tuple(marked), kwargs) if plain else _replace_tensors((args, kwargs), iter(marked))
            return (args, kwargs) if cast else None

        return hook

    def _make_post_forward(self, unit: Unit, unit_ref: weakref.ref):
        pre_backward = _pre_backward_hook(self._ref, unit_ref)

        @_outside_graphs
        def hook(module, args, output):
            if self.phase is Phase.BACKWARD:
                return None
            if events.listeners:
                events.emit("forward", unit.label, edge="end")
            grad = torch.is_grad_enabled()
            # even the unit that ran last, which backward needs first: held through the loss it
            # raises the peak by a unit where the loss is the peak (docs/architecture.md), and
            # the root's pre-backward prefetches it again
            if not grad or (unit.reshard_after_forward and not unit.is_root):
                unit.reshard()
            if grad:
                outs = [t for t in ((output,) if type(output) is torch.Tensor else flat_tensors(output, [])) if t.requires_grad]
                if len(outs) == 1:  # (what register_multi_grad_hook does for one, without its wrapping)
                    _on_gradient(outs[0], pre_backward)
                elif outs:
                    register_multi_grad_hook(outs, pre_backward, mode="any")
            if unit.is_root:
                self.next_forward = _successors(self.forward_order)
                if not grad:  # inference: nothing stays gathered
                    self.settle()
                if self.precision.output_dtype is not None:
                    return _cast_floats(output, self.precision.output_dtype)
            return None

        return hook

    @_outside_graphs
    def _note_forward_raised(self, module, args, output) -> None:
        """Runs after the root's forward even when it raised, with ``output`` None then."""
        if output is None:
            self.forward_raised = True

    # --- prefetch
    def _prefetch(self, nxt: Unit | None) -> None:
        """Issue the gather of ``nxt`` early, within the limit on gathered units.

        A unit that reshards after forward (full_shard): at most ``max_unsharded`` such
        non-root units gathered or gathering at once. One kept to backward (shard_grad_op):
        one gather in flight at a time. A plan may mix both (``UnitConfig``). A bucket of
        units counts as one unit (``Occupancy``): its one gather holds all its members.
        """
        if nxt is None or nxt.state is not UnitState.SHARDED or nxt.one_rank:
            return
        if nxt.reshard_after_forward:
            if self.occupancy.unsharded >= self.max_unsharded:
                return
        elif self.occupancy.gathering:
            return
        nxt.unshard()

    # --- backward
    def _pre_backward(self, unit: Unit) -> None:
        self._start_backward()
        if self.phase is not Phase.BACKWARD:
            self.phase = Phase.BACKWARD
            self.backward_order = []
        unit.wait_unshard()
        if events.listeners:
            events.emit("backward", unit.label, edge="begin")
        self.backward_order.append(unit)
        if not self.next_backward:  # first iteration: guess the reverse of forward
            fwd = _dedup(self.forward_order)
            self.next_backward = _successors([u for u in fwd if u.is_root] + [u for u in fwd[::-1] if not u.is_root])
        nxt = self.next_backward.get(unit)
        if nxt is not None and nxt.state is UnitState.SHARDED and not nxt.one_rank:
            self._prefetch(nxt)
        if self._tracks_peak and self.occupancy.unsharded > self.peak_unsharded:
            self.peak_unsharded = self.occupancy.unsharded

    def _make_grad_ready(self, unit_ref: weakref.ref, j: int):
        runtime_ref = self._ref  # Note [weak references from C++]

        def hook(param):
            rt, u = runtime_ref(), unit_ref()
            rt._start_backward()  # no_shard has no forward hooks that could
            u.grads_ready += 1
            u.used[j] = True
            # (only a unit's last gradient can let the reductions in order move on)
            if rt.sync_grads and u.grads_ready >= u.num_trainable and isinstance(u, ReplicatedUnit):
                rt._reduce_in_order(ready_only=True)

        return hook

    def _start_backward(self) -> None:
        """Queue the end-of-backward callback, once per backward, after clearing what a step
        that raised left behind (Note [a step that raised])."""
        if self.callback_queued and not self.forward_raised and self._callback() is not None:
            return  # (this backward's: every caller runs inside a backward)
        if self.step_abandoned():
            self.reset()
        if self.callback_queued:
            return
        callback = self._final_callback  # a bound method of its own, which only autograd holds
        Variable._execution_engine.queue_callback(callback)
        self._callback = weakref.ref(callback)
        self.callback_queued = True

    def _reduce_in_order(self, *, ready_only: bool) -> None:
        """Issue replicated units' reductions in ``reduce_order`` (Note [when a unit reduces])."""
        while self.next_in_order < len(self.reduce_order):
            u = self.reduce_order[self.next_in_order]
            if ready_only and u.grads_ready < u.num_trainable:
                return
            u.reduce_grads()
            self.unfinished.add(u)
            self.next_in_order += 1

    def reduce(self, unit: ShardedUnit) -> None:
        """Issue a sharded unit's gradient reduction once its backward is over. The reduction
        issued before it moves on first: its reduce-scatter is finished, so its scratch rows
        go before this one's are allocated (rather than every unit's staying to the end of
        backward), and, with hybrid sharding, its all-reduce across replicas is issued and
        left to overlap this one's reduce-scatter (and likewise the average across replica
        groups outside the job: one unit in flight per all-reduce that follows the
        reduce-scatter). The unit's full parameters are freed before its rows are allocated,
        not after."""
        for u in self.reducing:
            u.advance_reduce()
        while len(self.reducing) > self._all_reduces_after_scatter:
            done = self.reducing.pop(0)
            done.finish_reduce()
            self.unfinished.discard(done)
        if not unit.is_root:
            unit.reshard()
        unit.reduce_grads()
        self.unfinished.add(unit)
        if not unit.awaiting_bucket:  # (else its bucket's last member issues the reduction)
            self.reducing.append(unit)

    def post_backward(self, unit: Unit) -> None:
        """The backward of one forward call of the unit is complete."""
        self._start_backward()  # (where no pre-backward hook found the unit's outputs)
        if events.listeners:
            events.emit("backward", unit.label, edge="end")
        left = self.pending_backwards.get(unit, 1) - 1
        self.pending_backwards[unit] = left
        if left == 0 and self.sync_grads and isinstance(unit, ShardedUnit) and not unit.reduce_issued:
            self.reduce(unit)  # (which reshards it)
        elif not unit.is_root:
            unit.reshard()

    def _final_callback(self) -> None:
        ran = set(self.forward_order) | set(self.backward_order)
        self.ran_since_sync |= ran
        if self.sync_grads:
            self._reduce_in_order(ready_only=False)
            for u in self.units:  # a unit that ran reduces, whichever of its parameters got gradients
                if isinstance(u, ShardedUnit) and not u.reduce_issued and u in self.ran_since_sync:
                    self.reduce(u)
            for b in self.buckets:  # members that did not run complete their bucket's reduction
                for u in b.unpacked():
                    self.reduce(u)
            self.agreeing = self._agree_used()  # issued now, read after the last reductions' waits
            unfinished = [u for u in self.units if u in self.unfinished]
            for u in unfinished:  # every all-reduce across replicas in flight before any wait
                u.advance_reduce()
            for u in unfinished:
                u.finish_reduce()
            self.unfinished = set()
            agreed, self.agreeing = self.agreeing(), None
            self._keep_used(agreed)
            self.ran_since_sync = set()
        self.reducing = []
        self.next_in_order = 0
        self.pending_backwards = {}
        for u in self.units:
            u.grads_ready = 0
            u.reduce_issued = False
        self.next_backward = _successors(self.backward_order)
        self.callback_queued = False
        self.settle()
        self._rebucket()
        if events.listeners:
            events.emit("step_end", "")
        self._check_all_ran(ran)

    def _rebucket(self) -> None:
        """Bucket small units anew from this step's forward order, where it is not the order
        the buckets were made from (buckets.py); every unit is sharded now."""
        if not self._bucketable or (self.forward_order, self.bucket_bytes) == self._bucketed_by:
            return
        for b in self.buckets:
            b.dissolve()
        order = [u for u in _dedup(self.forward_order) if isinstance(u, ShardedUnit)]
        self.buckets = [buckets.Bucket(run) for run in buckets.plan(order, self.bucket_bytes)]
        self._bucketed_by = (self.forward_order, self.bucket_bytes)

    def _agree_used(self) -> Callable[[], list[bool]]:
        """Start agreeing with the other ranks on which parameters got a gradient anywhere
        (one small collective a step, which also compares the ranks' collectives:
        collectives.step_check); the returned function gives the answer."""
        flags = [f for u in self.units for f in u.used]
        if self.host_group is None:
            return lambda: flags
        if self.check_buffer is None:
            self.check_buffer = torch.empty(len(flags) + 2, dtype=torch.int64)
        return C.step_check(flags, self.host_group, self.check_buffer)

    def _keep_used(self, anywhere: list[bool]) -> None:
        """Parameters that got a gradient on no rank keep the ``.grad`` they had, as in one
        process."""
        start = 0
        for u in (u for u in self.units if u.num_trainable):
            u.keep_used(anywhere[start : start + u.num_trainable])
            start += u.num_trainable

    def step_abandoned(self) -> bool:
        """Whether the root's forward raised, or the last backward did: its end-of-backward
        callback was queued and never ran, and the backward that would have run it is over
        (Note [a step that raised])."""
        return self.forward_raised or (
            self.callback_queued and (self._callback() is None or not _in_backward())
        )

    def reset(self) -> None:
        """Clear the step that raised (Note [a step that raised]): wait for every collective in
        flight, discard the gradients not yet on the shards and the per-step state, reshard."""
        for u in self.units:
            u.reset()
        if self.agreeing is not None:
            agreeing, self.agreeing = self.agreeing, None
            agreeing()
        self.reducing = []
        self.unfinished = set()
        self.next_in_order = 0
        self.pending_backwards = {}
        self.ran_since_sync = set()
        self.backward_order = []
        self.callback_queued = False
        self.forward_raised = False
        self.settle()

    def settle(self) -> None:
        """End the step: every unit sharded, modules holding their shards again."""
        for u in self.units:
            u.reshard()
        self._expose_shards(True)
        self.phase = Phase.IDLE

    def _expose_shards(self, exposed: bool) -> None:
        for u in self.units:
            if isinstance(u, ShardedUnit):
                u.expose_shards(exposed)

    def _check_loss_scaling(self) -> None:
        if self.precision.needs_loss_scaling and self.grad_scaler is None and torch.is_grad_enabled():
            raise ShardwiseError(
                "mixed_precision uses float16, whose gradients underflow without loss scaling: "
                "create scaler = shardwise.GradScaler(model) after shard(), then "
                "scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update(). "
                "(bfloat16, 'bf16', needs no scaler.)"
            )

    def _check_all_ran(self, ran: set[Unit]) -> None:
        """After the first step, every unit with parameters must have been called as a module."""
        if self.ran_once:
            return
        self.ran_once = ran
        missing = [
            u.label for u in self.units if u not in ran and u.num_trainable and isinstance(u, ShardedUnit)
        ]
        if missing:
            raise ShardwiseError(
                f"units {missing} never ran their forward, so their parameters were never "
                "gathered; a unit must be a module that is called (not a container such as "
                "nn.ModuleList, and not a module whose parameters are used by its parent). "
                "Choose another wrap policy, or call shardwise.register_forward_method() for "
                "methods that use the parameters."
            )


def runtime_of(model: nn.Module) -> Runtime:
    """The runtime ``shard()`` attached to ``model`` (api and checkpoint both ask here)."""
    rt = getattr(model, "_shardwise", None)
    if rt is None:
        raise ShardwiseError(
            f"{type(model).__name__} is not sharded: pass the module that shardwise.shard() returned"
        )
    return rt


def require_idle(rt: Runtime, what: str) -> None:
    """Between steps, for ``what`` (a function that needs whole steps): clear a step that raised
    (Note [a step that raised]), refuse to run during backward, and end a forward whose
    backward never came (evaluation with grad enabled)."""
    if rt.step_abandoned():
        rt.reset()
    if rt.phase is Phase.BACKWARD:
        raise ShardwiseError(f"{what}() was called during backward; call it between steps")
    rt.settle()


def _cast_floats(obj, dtype: torch.dtype):
    """``obj`` with its floating-point tensors cast to ``dtype``."""
    tensors = flat_tensors(obj, [])
    return _replace_tensors(obj, iter(t.to(dtype) if t.is_floating_point() else t for t in tensors))


def _reverse_module_order(root: nn.Module, units: list[Unit]) -> list[Unit]:
    """``units`` in reverse order of their modules in ``root`` (children before parents):
    roughly the order their gradients complete in backward."""
    position = {m: i for i, m in enumerate(root.modules())}
    return sorted((u for u in units if u.num_trainable), key=lambda u: -position[u.module])


def _successors(order: list[Unit]) -> dict[Unit, Unit]:
    """Each unit's successor at its first appearance in ``order``."""
    nxt: dict[Unit, Unit] = {}
    for a, b in itertools.pairwise(order):
        if a is not b:
            nxt.setdefault(a, b)
    return nxt


def _dedup(order: list[Unit]) -> list[Unit]:
    seen, out = set(), []
    for u in order:
        if u not in seen:
            seen.add(u)
            out.append(u)
    return out
