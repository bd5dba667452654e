"""One unit's life cycle: sharded -> gathering -> unsharded -> (backward) -> reduced -> sharded.

A unit is a module chosen by the wrap policy (or the root) with the parameters it owns. It owns
its buffers: the persistent flat shard (the optimizer's parameters are views of it), the
unsharded buffer (storage allocated only while gathered), and the gradient collective in flight.
Transitions are verbs that check the state they start from.

Mixed precision and offload live here too: the flat shard is the master copy (fp32, in host
memory when offloaded); a gather first copies it to the compute device in the compute dtype,
and gradients are reduced in the reduction dtype and land on the shards in the master dtype.

Note [version counters]: the unsharded parameters are autograd leaves whose storage is
refilled by every gather; the copy writes through ``.data`` aliases, which have their own
version counters, so tensors that autograd saved in forward stay valid when backward gathers
again into the same storage.
"""

from __future__ import annotations

from enum import Enum, auto

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes

from . import collectives as C
from . import events, placement
from .codecs import Codec
from .errors import ShardwiseError
from .layout import Layout, Slot
from .policies import Comm, MixedPrecision
from .replica_groups import ReplicaGroups
from .streams import Streams


class UnitState(Enum):
    SHARDED = auto()
    GATHERING = auto()  # all-gather issued, not yet waited on
    UNSHARDED = auto()


class Occupancy:
    """How many of a runtime's gathers (a sharded unit, or a bucket of units: buckets.py) are
    in flight, and how many of those that reshard after forward (the root aside) are not
    sharded: kept by the units' state changes, so that prefetch reads them in constant time
    rather than counting every unit at every hook. A bucket counts once, while any of its
    members is gathering (not sharded): one collective gathers them all, and its rows are held
    until the last member has copied its part out; a bucket keeps its members' count in one of
    its own (``change``)."""

    __slots__ = ("gathering", "unsharded")

    def __init__(self) -> None:
        self.gathering = 0
        self.unsharded = 0

    def change(self, gathering: int, unsharded: int) -> tuple[int, int]:
        """Add a member's change to a bucket's count; what that changes in the runtime's (a
        bucket's first member to leave SHARDED, or its last to come back)."""
        was_gathering, was_unsharded = self.gathering > 0, self.unsharded > 0
        self.gathering += gathering
        self.unsharded += unsharded
        return (self.gathering > 0) - was_gathering, (self.unsharded > 0) - was_unsharded


class NotGathered(torch.Tensor):
    """What a sharded unit's modules hold during a step: any use outside the unit's forward
    raises, naming the parameter, instead of computing silently on this rank's shard."""

    _shardwise_name: str
    _shardwise_unit: str
    _METADATA = frozenset({
        "shape", "dtype", "device", "requires_grad", "ndim", "is_meta", "size", "dim", "numel",
        "layout", "stride", "storage_offset", "is_contiguous", "is_floating_point", "element_size",
        "itemsize", "nbytes", "untyped_storage", "data_ptr", "is_leaf", "grad", "grad_fn", "_base",
        "is_sparse", "is_quantized", "is_nested", "is_cuda", "is_cpu", "register_hook",
        "register_post_accumulate_grad_hook", "__hash__", "__eq__",
    })

    @staticmethod
    def make(shape: tuple[int, ...], dtype: torch.dtype, name: str, unit: str, requires_grad: bool) -> NotGathered:
        # memory tools (e.g. torch's MemTracker) read parameters and hook them in pre-forward
        # hooks that may run before the unit's own: metadata and hook registration work.
        # A plain meta tensor, even where a dispatch mode is active (the planner's fake tensors)
        with _disable_current_modes():
            meta = torch.empty(shape, dtype=dtype, device="meta")
        t = torch.Tensor._make_subclass(NotGathered, meta, requires_grad)
        t._shardwise_name, t._shardwise_unit = name, unit
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        owner = getattr(func, "__self__", None)  # property getters: the descriptor
        name = getattr(owner, "__name__", None) or getattr(func, "__name__", "")
        if name in cls._METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        culprit = next(
            (a for a in list(args) + list((kwargs or {}).values()) if isinstance(a, NotGathered)), None
        )
        pname = culprit._shardwise_name if culprit is not None else "?"
        unit = culprit._shardwise_unit if culprit is not None else "?"
        raise ShardwiseError(
            f"parameter '{pname}' was used while its unit '{unit}' is sharded ({name}): a unit "
            "gathers its parameters only while its module is called. Call the module rather than "
            "reading its parameters from outside, wrap a module that contains every use, or use "
            "shardwise.register_forward_method() / shardwise.gathered()."
        )


class Registration:
    """One place a parameter is registered: ``module._parameters[attr]`` is slot ``index``;
    ``fqn`` is that place's qualified name in the model's state dict."""

    __slots__ = ("module", "attr", "index", "fqn")

    def __init__(self, module: nn.Module, attr: str, index: int, fqn: str):
        self.module, self.attr, self.index, self.fqn = module, attr, index, fqn


class Unit:
    """Base of both unit kinds; ``name`` is the module's qualified name ('' for the root)."""

    state: UnitState
    reshard_after_forward = False  # whole parameters stay put (a replicated unit has no others)
    one_rank = False  # a sharded unit over one rank that gathers itself at its wait (never prefetched)
    shared = False  # a one-rank unit whose module computes on the shard parameters (ShardedUnit)

    def __init__(
        self, module: nn.Module, name: str, registrations: list[Registration], group, replica_groups: ReplicaGroups | None
    ):
        self.module, self.name, self.registrations, self.group = module, name, registrations, group
        self._places = [(r.module._parameters, r.attr, r.index) for r in registrations]  # (for _swap)
        # replica groups outside the job (replica_groups.py): gradients are averaged across them once
        # the job's own reduction is complete
        self.replica_groups = replica_groups
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.label = name or "<root>"
        self.is_root = name == ""
        self.channel = C.channel()  # Note [tagged Gloo messages] in collectives.py
        self.grads_ready = 0  # trainable parameters whose gradient is complete this backward
        self.reduce_issued = False
        # per trainable parameter: got a gradient on this rank since the last reduction
        # (no_sync micro-batches included); set as a sharded unit reduces, by the runtime's
        # gradient hooks on a replicated one
        self.used: list[bool] = []
        # per trainable parameter: its .grad was None before this reduction landed
        self._fresh: list[bool] = []
        self.comm = Comm()
        # error feedback: per collective kind, what encoding dropped from this rank's
        # outgoing gradient rows (Note [wire precision] in collectives.py); saved in checkpoints
        self.residuals: dict[str, torch.Tensor] = {}

    def set_residuals(self, residuals: dict[str, torch.Tensor]) -> None:
        """Replace the error feedback residuals by ``residuals`` (by kind; empty: start
        afresh), as fault tolerance does when a rank heals or a step is undone."""
        self.residuals = dict(residuals)

    def _residual(self, kind: str, codec: Codec | None, numel: int, like: torch.Tensor) -> torch.Tensor | None:
        """The flat residual of ``kind`` (``numel`` zeros at first, in ``like``'s dtype and
        device) where this collective is encoded with error feedback; else None."""
        if codec is None or not self.comm.error_feedback:
            return None
        kept = self.residuals.get(kind)
        if kept is None or kept.numel() != numel:  # (loaded for another layout: start again)
            kept = self.residuals[kind] = torch.zeros(numel, dtype=like.dtype, device=like.device)
        elif kept.device != like.device or kept.dtype != like.dtype:  # loaded from a checkpoint
            kept = self.residuals[kind] = kept.to(like.device, like.dtype)
        return kept

    def keep_used(self, anywhere: list[bool]) -> None:
        """After the reduction: a trainable parameter that got a gradient on no rank keeps the
        ``.grad`` it had before (None, or a kept gradient the reduction added zeros to), as in
        one process, so the optimizer skips it. ``anywhere`` is the ranks' agreement."""
        for p, fresh, used in zip(self._grad_holders(), self._fresh, anywhere):
            if fresh and not used:
                p.grad = None
        self._fresh = []
        self.used = [False] * len(self.used)

    def _grad_holders(self) -> list[nn.Parameter]:
        """The parameters the optimizer steps that get this unit's reduced gradients."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget this step's gradient bookkeeping (after a step that raised: Note [a step
        that raised] in runtime.py)."""
        self.grads_ready = 0
        self.reduce_issued = False
        self.used = [False] * len(self.used)
        self._fresh = []

    def _swap(self, params) -> None:
        """Point every registration of this unit's parameters at ``params`` (one per slot)."""
        for where, attr, index in self._places:
            where[attr] = params[index]


class ShardedUnit(Unit):
    """A unit whose parameters are sharded over the group (full_shard / shard_grad_op)."""

    def __init__(
        self,
        module: nn.Module,
        name: str,
        registrations: list[Registration],
        group,
        layout: Layout,
        flat_shard: torch.Tensor,
        requires_grad: list[bool],
        *,
        device: torch.device,
        precision: MixedPrecision,
        offload: bool = False,
        reshard_after_forward: bool = True,
        streams: Streams | None = None,
        replicate=None,
        comm: Comm | None = None,
        replica_groups: ReplicaGroups | None = None,
    ):
        super().__init__(module, name, registrations, group, replica_groups)
        # precision on the wire; nothing leaves a rank in a group of one
        self.comm = comm or Comm()
        self.gather_codec = self.comm.gather_codec if self.world > 1 else None
        self.reduce_codec = self.comm.reduce_codec if self.world > 1 else None
        self.reshard_after_forward = reshard_after_forward  # (UnitConfig; never the root's)
        # hybrid sharding: the same-position ranks of the other shard groups, which hold the
        # same shards; gradients are all-reduced over them after the reduce-scatter
        self.replicate = replicate
        self.replicate_size = dist.get_world_size(replicate) if replicate is not None else 1
        self.replicate_codec = self.comm.replicate_codec if self.replicate_size > 1 else None
        self.layout = layout
        self.requires_grad = requires_grad
        self.grad_layout = layout.subset(requires_grad)
        self.num_trainable = sum(requires_grad)
        self.used = [False] * self.num_trainable
        self.flat_shard = flat_shard  # the master copy; host memory when offloaded
        self.device = device
        self.compute_dtype = precision.compute_dtype(flat_shard.dtype)
        self.reduce_dtype = precision.reduction_dtype(flat_shard.dtype)
        self.offloaded = offload
        # the gather reads the flat shard directly unless it must first move or change dtype
        # (offloaded: always a copy, even where host and device are the same memory)
        self._direct = not offload and self.compute_dtype == flat_shard.dtype
        # a gradient in the reduction dtype is in the master's dtype and memory already
        self._reduced_is_master = not offload and self.reduce_dtype == flat_shard.dtype
        self.streams = streams  # CUDA side streams; None on CPU (Note [stream ordering])
        self._make_params(layout, flat_shard, requires_grad, device, streams)
        self.exposed = True  # between steps the modules hold the shard parameters
        self._free_full()
        self.state = UnitState.SHARDED
        self.occupancy: Occupancy | None = None  # the runtime's (``count_in``)
        self._send: torch.Tensor | None = None
        self._gather: C.Pending | None = None
        self._gathered = None  # CUDA: the event after the gather, on the gather stream
        self._reduce: C.Pending | None = None  # the reduce-scatter in flight
        self._replicate_reduce: C.Pending | None = None  # the all-reduce after it in flight (across replicas)
        self._stages: list = []  # the all-reduces after it still to issue, in order
        self._reduce_out: torch.Tensor | None = None
        self._reduce_rows: C.ScatterRows | None = None  # CUDA: held until compute waits (rule 3)
        self._reduced = None  # CUDA: the event after the reduction, on the reduce stream
        self._local_grads: list[torch.Tensor] | None = None
        self.bucket = None  # the buckets.Bucket whose collectives carry this unit's, if any
        self.awaiting_bucket = False  # gradients packed into the bucket, its reduction not issued
        self._swap(self.shard_params)

    def _make_params(self, layout: Layout, flat_shard: torch.Tensor, requires_grad: list[bool], device, streams) -> None:
        """The shard parameters (views of the flat shard), the full parameters (views of the
        full buffer, or of the flat shard itself where nothing is gathered) and the
        placeholders the modules hold mid-step."""
        self.shard_params = [
            shard_param(v, rg, slot, self.world)
            for v, rg, slot in zip(layout.shard_views(flat_shard, self.rank), requires_grad, layout.slots)
        ]
        # one rank, no cast, no offload: the shard is the whole parameter, so the full
        # parameters are views of the flat shard itself and gathering is only the swap
        self._alias = self.world == 1 and self._direct
        # one rank with a cast or an offload: the flat shard is laid out as the full buffer,
        # so the gather is one copy (casting) into it at the wait, with no collective to issue
        self._alone = self.world == 1 and not self._direct and streams is None
        # either way the unit's own wait does the whole gather on this thread: prefetching it
        # would only move that work, so it is neither prefetched nor counted (``Occupancy``)
        self.one_rank = self._alias or self._alone
        self.flat_full = (
            flat_shard
            if self._alias
            else torch.empty(layout.unsharded_numel, dtype=self.compute_dtype, device=device)
        )
        self._flat_full_data = self.flat_full.data  # see Note [version counters]
        self._unpack = layout.unpacker(self._flat_full_data)
        # one rank, nothing to reduce (no replicas), no cast, every shard shaped as its
        # parameter: the module computes on the shard parameters themselves, whose gradients
        # need no move (as in one process)
        self.shared = (
            self._alias and self.replicate_size == 1 and self.replica_groups is None
            and all(s.shape == slot.shape for s, slot in zip(self.shard_params, layout.slots))
        )
        self.full_params = self.shard_params if self.shared else [
            nn.Parameter(v, requires_grad=rg)
            for v, rg in zip(layout.unsharded_views(self.flat_full), requires_grad)
        ]
        self._trainable_full = [p for p in self.full_params if p.requires_grad]
        self._trainable_shards = [p for p, rg in zip(self.shard_params, requires_grad) if rg]
        self.not_gathered = [
            NotGathered.make(s.shape, flat_shard.dtype, s.name, self.label, rg)
            for s, rg in zip(layout.slots, requires_grad)
        ]

    def enter(self, new: UnitState) -> None:
        """Move to state ``new``, keeping the runtime's ``Occupancy`` up to date (``state``
        is a plain attribute that hooks read often; only this writes it)."""
        old, occ = self.state, self.occupancy
        if occ is not None and old is not new:
            gathering = (new is UnitState.GATHERING) - (old is UnitState.GATHERING)
            unsharded = (old is UnitState.SHARDED) - (new is UnitState.SHARDED) if self._counted else 0
            if self.bucket is not None:  # (the bucket counts as one)
                gathering, unsharded = self.bucket.occupancy.change(gathering, unsharded)
            occ.gathering += gathering
            occ.unsharded += unsharded
        self.state = new

    def count_in(self, occupancy: Occupancy) -> None:
        """Keep ``occupancy`` up to date with this unit's state from now on (not a unit over
        one rank: ``one_rank``)."""
        if self.one_rank:
            return
        self._counted = self.reshard_after_forward and not self.is_root
        state, self.state = self.state, UnitState.SHARDED
        self.occupancy = occupancy
        self.enter(state)

    # --- parameters as the module sees them
    def expose_shards(self, exposed: bool) -> None:
        """Between steps (True) modules hold the shard parameters; during one, placeholders
        that raise if used outside the unit's forward."""
        self.exposed = exposed
        if self.state is UnitState.SHARDED:
            self._swap(self.shard_params if exposed else self.not_gathered)

    def _free_full(self) -> None:
        if not self._alias:
            self.flat_full.untyped_storage().resize_(0)

    def _allocate_full(self) -> None:
        self.flat_full.untyped_storage().resize_(self.flat_full.numel() * self.flat_full.element_size())

    # --- forward/backward transitions
    def unshard(self) -> None:
        """Issue the all-gather of this unit's parameters (no wait): SHARDED -> GATHERING.
        A unit over one rank (``one_rank``) has nothing to issue: its wait gathers."""
        if self.state is not UnitState.SHARDED or self.one_rank:
            return
        if self.bucket is not None:  # one gather for the bucket's members
            self.bucket.gather()
            return
        # the gather receives into rows of its own; the full buffer is allocated only at the
        # wait, for the copy-out
        if self.streams is not None:
            self._gathered = self._gather_on_streams(self.streams)
        else:
            self._send = (
                self.flat_shard
                if self._direct
                else self.flat_shard.to(self.device, self.compute_dtype, copy=True)
            )
            self._gather = self._all_gather(self._send)
        self.enter(UnitState.GATHERING)
        if events.listeners:
            events.emit("gather_issue", self.label, bytes=self._gather.nbytes)

    def _gather_on_streams(self, s: Streams):
        """Cast (or copy from pinned host memory) on the copy-in stream, gather on the gather
        stream; return the event compute waits on before the copy-out (Note [stream ordering])."""
        compute = s.compute()
        if self._direct:
            s.gather.wait_stream(compute)
            self._send = self.flat_shard
        else:
            s.copy_in.wait_stream(compute)
            with s.use(s.copy_in):
                self._send = self.flat_shard.to(self.device, self.compute_dtype, non_blocking=True, copy=True)
            s.gather.wait_stream(s.copy_in)
        with s.use(s.gather):
            self._gather = self._all_gather(self._send)
            self._gather.wait()  # the gather stream waits for it, not the CPU
            return s.gather.record_event()

    def _all_gather(self, send: torch.Tensor) -> C.Pending:
        """The life cycle's gather, encoded on the wire as ``comm.gather`` says (state dicts'
        ``gather_full`` stays exact). Weights are encoded afresh from the master copy at every
        gather, so their rounding never accumulates: no error feedback is needed there."""
        return C.all_gather(send, self.group, self.label, self.channel, self.layout.sizes, self.gather_codec)

    def wait_unshard(self) -> None:
        """Finish the gather and point the module at the full parameters: -> UNSHARDED."""
        if self.state is UnitState.SHARDED:
            if self._alone:  # one rank with a cast: the gather is one casting copy
                C.book_alone("all_gather", self.label, self.flat_shard.numel(), self.compute_dtype)
                if events.listeners:
                    events.emit("gather_issue", self.label, bytes=self.flat_full.numel() * self.flat_full.element_size())
                self._allocate_full()
                self._flat_full_data.copy_(self.flat_shard)
            if self.one_rank:  # (without a cast the full parameters are views of the shard)
                self._swap(self.full_params)
                self.enter(UnitState.UNSHARDED)
                if events.listeners:
                    events.emit("gather_done", self.label)
                return
            self.unshard()
        if self.state is UnitState.GATHERING:
            if self._gather is not None:
                if self._gathered is not None:
                    self.streams.compute().wait_event(self._gathered)
                else:
                    self._gather.wait()
                self._allocate_full()
                self._unpack(self._gather.result if self.bucket is None else self.bucket.rows_of(self))
            self._send = self._gather = self._gathered = None  # (rule 3: after the copy-out)
            self._swap(self.full_params)
            self.enter(UnitState.UNSHARDED)
            if events.listeners:
                events.emit("gather_done", self.label)

    def reshard(self) -> None:
        """Free the full parameters and point the module at its shards: -> SHARDED."""
        if self.state is UnitState.GATHERING:
            self.wait_unshard()
        if self.state is UnitState.UNSHARDED:
            self._swap(self.shard_params if self.exposed else self.not_gathered)
            self._free_full()
            self.enter(UnitState.SHARDED)
            if events.listeners:
                events.emit("reshard", self.label)

    def reduce_grads(self) -> None:
        """Reduce-scatter this unit's full gradients in one collective (no wait).

        In a 16-bit reduction dtype the gradients are divided by N before the sum so that it
        cannot overflow; otherwise after it, which keeps fp32 results identical to one process.
        """
        if self.reduce_issued or self.num_trainable == 0:
            self.reduce_issued = True
            return
        if self.shared:  # the gradients are on the shard parameters already
            self.used = [p.grad is not None for p in self._trainable_full]
            self._local_grads = self._reduce_out = self._reduce = None
            self.reduce_issued = True
            return
        grads = []
        for j, p in enumerate(self._trainable_full):
            if p.grad is None:
                grads.append(torch.zeros_like(p))
            else:  # got a gradient since the last reduction (no_sync's micro-batches included)
                self.used[j] = True
                grads.append(p.grad)
                p.grad = None
        if self.world * self.replicate_size == 1 and self.replica_groups is None and (self._direct or self.streams is None):
            # nothing to reduce: the gradients are the shards' (direct), or each is only
            # brought to the reduction dtype and then to the master's, as the rows would be
            self._predivided = False
            if not self._direct:
                grads = [g.to(self.reduce_dtype) for g in grads]
                if not self._reduced_is_master:
                    grads = [self._to_master(g) for g in grads]
                if events.listeners:
                    numel = self.grad_layout.sizes[0]
                    events.emit("reduce_issue", self.label, bytes=numel * self.reduce_dtype.itemsize)
            self._local_grads = grads
            self._reduce_out = self._reduce = None
            self.reduce_issued = True
            return
        if self.bucket is not None:
            self.reduce_issued = self.awaiting_bucket = True
            self.bucket.pack(self, grads)
            return
        buf = C.scatter_rows(self.grad_layout.sizes, self.reduce_dtype, self.device, self.group)
        self.grad_layout.pack(grads, buf.rows, buf.full)  # casts to the reduction dtype on the way
        del grads
        self._predivided = self.reduce_dtype.itemsize < 4 and self.world * self.replicate_size > 1
        if self._predivided:
            for row in [buf.full] if buf.full is not None else buf.rows:
                row.div_(self.world * self.replicate_size)
        self._reduce_out = buf.out
        self._replicate_reduce = None
        self._stages = [] if self.streams is not None else self._all_reduces()
        if self.streams is not None:
            self._reduce_on_stream(self.streams, buf)
        else:
            self._reduce = self._reduce_scatter(buf) if self.world > 1 else None
        self.reduce_issued = True
        if events.listeners:
            events.emit("reduce_issue", self.label, bytes=self.world * buf.out.numel() * buf.out.element_size())

    def take_reduction(self, pending: C.Pending, out: torch.Tensor, stages: list) -> None:
        """This unit's part of its bucket's reduce-scatter, issued: ``out`` will hold its summed
        gradient shard once ``stages`` (the bucket's all-reduce across replicas, if any) are done."""
        self.awaiting_bucket = False
        self._predivided = self.reduce_dtype.itemsize < 4 and self.world * self.replicate_size > 1
        self._reduce, self._reduce_out, self._replicate_reduce, self._stages = pending, out, None, list(stages)
        if events.listeners:
            events.emit("reduce_issue", self.label, bytes=self.world * out.numel() * out.element_size())

    def _reduce_scatter(self, buf: C.ScatterRows) -> C.Pending:
        residual = self._residual("reduce_scatter", self.reduce_codec, sum(r.numel() for r in buf.rows), buf.out)
        return C.reduce_scatter(buf, self.group, self.label, self.channel, self.reduce_codec, residual)

    def _all_reduces(self) -> list:
        """What follows the reduce-scatter, in order: hybrid sharding's all-reduce across the
        job's replicas, then the average across replica groups outside the job."""
        stages = [self._replica_all_reduce] if self.replicate is not None else []
        return stages + ([self._replica_groups_all_reduce] if self.replica_groups is not None else [])

    def advance_reduce(self) -> None:
        """Take the reduction one stage on: finish the collective in flight (the
        reduce-scatter, or an all-reduce after it) and issue the next all-reduce of its result,
        if any (no wait)."""
        pending = self._reduce or self._replicate_reduce
        if pending is not None:
            pending.wait()
            self._reduce = self._replicate_reduce = None
        if self._stages and self._reduce_out is not None:
            self._replicate_reduce = self._stages.pop(0)(self._reduce_out)

    def _replica_groups_all_reduce(self, shard: torch.Tensor) -> C.Pending:
        # Note [the job's average before the groups']
        if not self._predivided and self.world * self.replicate_size > 1:
            shard.div_(self.world * self.replicate_size)
            self._predivided = True
        return C.replica_groups_all_reduce(shard, self.replica_groups, self.label, numel=max(self.grad_layout.sizes))

    def _replica_all_reduce(self, shard: torch.Tensor) -> C.Pending:
        # with owned parameters each shard position reduces its own size: records note the largest
        return C.all_reduce(
            shard, self.replicate, self.label, kind="replicate_all_reduce", numel=max(self.grad_layout.sizes),
            codec=self.replicate_codec, channel=self.channel,
            residual=self._residual("replicate_all_reduce", self.replicate_codec, shard.numel(), shard),
        )

    def finish_reduce(self) -> None:
        """Wait for the reduction, average, and leave ``.grad`` on the shard parameters (in the
        shards' dtype, in host memory when offloaded)."""
        shards = self._grad_holders()
        if self._local_grads is not None:
            self._fresh = [p.grad is None for p in shards]
            for p, g in zip(shards, self._local_grads):
                if g.shape != p.shape:  # (a 0-dim parameter's shard has one row)
                    g = g.view(p.shape)
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad += g
            self._local_grads = None
            if events.listeners and not self._direct:
                events.emit("reduce_done", self.label)
            return
        if self.awaiting_bucket:
            raise ShardwiseError(f"unit '{self.label}' finished a reduction its bucket has not issued")
        if self._reduce_out is None:
            return
        out = self._reduced_shard()
        views = self.grad_layout.shard_views(out, self.rank)
        self._fresh = [p.grad is None for p in shards]
        for p, g, slot in zip(shards, views, self.grad_layout.slots):
            if slot.owned and slot.owner != self.rank:  # its owner holds its gradient
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad += g
        self._reduce = self._reduce_out = self._replicate_reduce = None
        self._stages = []
        if events.listeners:
            events.emit("reduce_done", self.label)

    def _grad_holders(self) -> list[nn.Parameter]:
        return self._trainable_shards

    def reset(self) -> None:
        """After a step that raised: wait for this unit's gather and reduction in flight (every
        rank issued them alike), drop their results and the full parameters' gradients (the
        failed step's, and those accumulated under no_sync), and reshard without copying out."""
        if self._gathered is not None:
            self.streams.compute().wait_event(self._gathered)
        elif self._gather is not None:
            self._gather.wait()
        for pending in (self._reduce, self._replicate_reduce):
            if pending is not None:
                pending.wait()
        if self._reduced is not None:
            self.streams.compute().wait_event(self._reduced)
        self._send = self._gather = self._gathered = self._local_grads = None
        self._reduce = self._replicate_reduce = self._reduce_out = self._reduce_rows = self._reduced = None
        self._stages = []
        self.awaiting_bucket = False
        if self.bucket is not None:
            self.bucket.reset()
        if not self.shared:  # (else they are the shards': the caller's to zero, as in one process)
            for p in self.full_params:
                p.grad = None
        if self.state is not UnitState.SHARDED:
            self._swap(self.shard_params if self.exposed else self.not_gathered)
            self._free_full()
            self.enter(UnitState.SHARDED)
        super().reset()

    def _reduce_on_stream(self, s: Streams, buf: C.ScatterRows) -> None:
        """Reduce-scatter, average and bring the result to the master's dtype and memory on
        the reduce stream, after the packing on compute (Note [stream ordering])."""
        s.reduce.wait_stream(s.compute())
        with s.use(s.reduce):
            if self.world > 1:
                # the stream waits for it, not the CPU
                self._reduce_scatter(buf).wait()
            if self.replicate is not None:
                self._replica_all_reduce(buf.out).wait()
            if self.replica_groups is not None:
                self._replica_groups_all_reduce(buf.out).wait()
            self._reduce_out = self._to_master(buf.out)
            self._reduced = s.reduce.record_event()
        self._reduce_rows = buf  # compute allocated them: held until it waits (rule 3)

    def _reduced_shard(self) -> torch.Tensor:
        """This rank's averaged gradient shard in the master's dtype and memory, once its
        reduction is complete (compute waits for it; the CPU too when it is in host memory)."""
        if self._reduced is None:  # CPU: the collectives are waited for here
            while self._reduce is not None or self._replicate_reduce is not None or self._stages:
                self.advance_reduce()
            return self._to_master(self._reduce_out)
        self.streams.compute().wait_event(self._reduced)
        if self._reduce_out.device.type == "cpu":  # offloaded: the CPU optimizer reads it next
            self._reduced.synchronize()
        self._reduced = self._reduce_rows = None
        return self._reduce_out

    def _to_master(self, out: torch.Tensor) -> torch.Tensor:
        """The summed shard ``out`` averaged (unless divided before the sum), in the master
        copy's dtype and memory (pinned host memory when offloaded: copied without blocking)."""
        if not self._predivided and self.world * self.replicate_size > 1:
            out.div_(self.world * self.replicate_size)
        master = self.flat_shard
        if self.offloaded or out.dtype != master.dtype or out.device != master.device:
            host = torch.empty(out.shape, dtype=master.dtype, device=master.device, pin_memory=master.is_pinned())
            out = host.copy_(out, non_blocking=master.is_pinned())
        return out

    # --- whole-parameter access outside the life cycle (state dicts, inspection)
    def gather_full(self) -> list[torch.Tensor]:
        """The full parameters in the master dtype, as fresh tensors (one blocking all-gather)."""
        gather = C.all_gather(
            self.flat_shard.to(self.device), self.group, self.label, self.channel, self.layout.sizes
        )
        gather.wait()
        full = torch.empty(self.layout.unsharded_numel, dtype=self.flat_shard.dtype, device=self.device)
        self.layout.unpack(gather.result, full)
        return self.layout.unsharded_views(full)

    def load_full(self, tensors: list[torch.Tensor]) -> None:
        """Set this rank's shards from full tensors (one per slot, the same on every rank)."""
        with torch.no_grad():
            row = torch.empty_like(self.flat_shard)  # the tensors may alias the shard (one rank)
            self.layout.pack_row([t.to(self.flat_shard) for t in tensors], self.rank, row)
            self.flat_shard.copy_(row)


def shard_param(view: torch.Tensor, requires_grad: bool, slot: Slot, world: int) -> nn.Parameter:
    """The parameter the optimizer steps for one slot on this rank, with its placement
    recorded (``placement.of``)."""
    p = nn.Parameter(view, requires_grad=requires_grad)
    placement.mark(p, slot, world)
    return p


class ReplicatedUnit(Unit):
    """A unit whose parameters stay whole on every rank (no_shard): gradients are all-reduced.

    Without mixed precision the module computes on the parameters themselves and needs no
    forward hooks (like DDP). With it, "unshard" casts them into compute copies, which get
    the gradients; those are all-reduced in the reduction dtype onto the parameters.
    """

    def __init__(
        self,
        module: nn.Module,
        name: str,
        registrations: list[Registration],
        group,
        params: list[nn.Parameter],
        *,
        precision: MixedPrecision,
        comm: Comm | None = None,
        replica_groups: ReplicaGroups | None = None,
    ):
        super().__init__(module, name, registrations, group, replica_groups)
        self.comm = comm or Comm()
        self.reduce_codec = self.comm.reduce_codec if self.world > 1 else None
        self.params = params
        storage = params[0].dtype if params else torch.float32
        self.compute_dtype = precision.compute_dtype(storage)
        self.reduce_dtype = precision.reduction_dtype(storage)
        self.casts = self.compute_dtype != storage
        if self.casts:
            self.full_params = [
                nn.Parameter(torch.empty_like(p, dtype=self.compute_dtype), requires_grad=p.requires_grad)
                for p in params
            ]
            self._compute_data = [c.data for c in self.full_params]  # Note [version counters]
            self.state = UnitState.SHARDED
        else:
            self.full_params = params
            self.state = UnitState.UNSHARDED
        self.trainable = [i for i, p in enumerate(params) if p.requires_grad]
        self.num_trainable = len(self.trainable)
        self.used = [False] * self.num_trainable
        # no cast either way: one bucket for the unit's life, like DDP's, and the parameters'
        # gradients become its views (DDP's gradient_as_bucket_view): no fresh bucket memory
        # each step, nothing copied back after the all-reduce, kept gradients reduced in place
        self._flat_grad: torch.Tensor | None = None
        self._grad_views: list[torch.Tensor] = []
        if not self.casts and self.reduce_dtype == storage and self.num_trainable:
            trained = [params[i] for i in self.trainable]
            self._flat_grad = torch.empty(sum(p.numel() for p in trained), dtype=storage, device=trained[0].device)
            sizes = [p.numel() for p in trained]
            self._grad_views = [g.view_as(p) for g, p in zip(self._flat_grad.split(sizes), trained)]
        self._reduce: C.Pending | None = None
        self._replica_groups_reduce: C.Pending | None = None  # the average across replica groups outside the job
        self._bucket: torch.Tensor | None = None
        self._pieces: list[torch.Tensor] | None = None  # one rank with a cast: each gradient, cast
        self._numels = [params[i].numel() for i in self.trainable]  # the bucket's pieces

    def unshard(self) -> None:
        if self.state is UnitState.SHARDED:
            if self.params:
                with torch.no_grad():
                    torch._foreach_copy_(self._compute_data, self.params)
            self._swap(self.full_params)
            self.state = UnitState.UNSHARDED

    def wait_unshard(self) -> None:
        self.unshard()

    def reshard(self) -> None:
        if self.casts and self.state is UnitState.UNSHARDED:
            self._swap(self.params)
            self.state = UnitState.SHARDED

    def expose_shards(self, exposed: bool) -> None:
        pass

    def reduce_grads(self) -> None:
        """All-reduce this unit's gradients as one flat bucket (no wait)."""
        if self.reduce_issued or self.num_trainable == 0:
            self.reduce_issued = True
            return
        compute = [self.full_params[i] for i in self.trainable]
        if self._flat_grad is not None:
            self._fresh = [c.grad is None for c in compute]
            for c, view in zip(compute, self._grad_views):
                if c.grad is None:
                    view.zero_()
                elif c.grad is not view:  # (else a kept gradient, accumulated in place)
                    view.copy_(c.grad)
                c.grad = view
            self._bucket = self._flat_grad
        elif self.world == 1 and self.replica_groups is None:
            # nothing to reduce: each gradient is only brought to the reduction dtype and then
            # the parameter's, as its piece of the bucket would be (no concatenation and split
            # per step)
            self._pieces = [
                (c.grad.to(self.reduce_dtype) if c.grad is not None else torch.zeros_like(c, dtype=self.reduce_dtype)).to(p.dtype)
                for c, p in zip(compute, self._grad_holders())
            ]
        else:
            self._bucket = torch.cat([
                c.grad.reshape(-1) if c.grad is not None else c.new_zeros(c.numel()) for c in compute
            ]).to(self.reduce_dtype)
        if self.casts:
            for c in compute:
                c.grad = None
        if self._pieces is not None:
            self.reduce_issued = True
            if events.listeners:
                events.emit("reduce_issue", self.label, bytes=sum(self._numels) * self.reduce_dtype.itemsize)
            return
        if self.world > 1:
            self._reduce = C.all_reduce(  # see Runtime.reduce
                self._bucket, self.group, self.label, codec=self.reduce_codec, channel=self.channel,
                residual=self._residual("all_reduce", self.reduce_codec, self._bucket.numel(), self._bucket),
            )
        self.reduce_issued = True
        if events.listeners:
            events.emit("reduce_issue", self.label, bytes=self._bucket.numel() * self._bucket.element_size())

    def advance_reduce(self) -> None:
        """Finish the all-reduce within the job and issue the average across replica groups
        outside it, if any (no wait)."""
        if self._reduce is not None:
            self._reduce.wait()
            self._reduce = None
        if self.replica_groups is not None and self._bucket is not None and self._replica_groups_reduce is None:
            if self.world > 1:  # Note [the job's average before the groups']
                self._bucket.div_(self.world)
            self._replica_groups_reduce = C.replica_groups_all_reduce(self._bucket, self.replica_groups, self.label)

    def finish_reduce(self) -> None:
        if self._pieces is not None:  # (in the parameters' dtype already)
            pieces, self._pieces = self._pieces, None
            params = self._grad_holders()
        elif self._bucket is None:
            return
        else:
            self.advance_reduce()
            if self._replica_groups_reduce is not None:
                self._replica_groups_reduce.wait()
                self._replica_groups_reduce = None
            elif self.world > 1:
                self._bucket.div_(self.world)
            if self._flat_grad is not None:  # the gradients are views of the bucket already
                self._reduce = self._bucket = None
                if events.listeners:
                    events.emit("reduce_done", self.label)
                return
            params = self._grad_holders()
            pieces = [b.view_as(p).to(p.dtype) for b, p in zip(self._bucket.split(self._numels), params)]
        self._fresh = [p.grad is None for p in params]
        for p, b in zip(params, pieces):
            if p.grad is None:
                p.grad = b
            elif self.casts:  # the compute copies' gradients add to the parameters' own
                p.grad += b
            else:  # the parameters' own gradients, now averaged
                p.grad.copy_(b)
        self._reduce = self._bucket = None
        if events.listeners:
            events.emit("reduce_done", self.label)

    def _grad_holders(self) -> list[nn.Parameter]:
        return [self.params[i] for i in self.trainable]

    def reset(self) -> None:
        """After a step that raised: wait for the all-reduce in flight (every rank issued it
        alike) and drop it; with casts, drop the compute copies' gradients and reshard. The
        parameters' own gradients are the caller's to zero, as in one process."""
        for pending in (self._reduce, self._replica_groups_reduce):
            if pending is not None:
                pending.wait()
        self._reduce = self._replica_groups_reduce = self._bucket = self._pieces = None
        if self.casts:
            for c in self.full_params:
                c.grad = None
            self.reshard()
        super().reset()

    def gather_full(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.params]

    def load_full(self, tensors: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, t in zip(self.params, tensors):
                p.copy_(t)

