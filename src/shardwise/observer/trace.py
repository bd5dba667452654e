"""The tracer: what every rank did and held during a run, event by event.

    with shardwise.trace(model, optimizer) as t:
        for step in range(3):
            model(x, y).backward(); optimizer.step(); optimizer.zero_grad()
    if dist.get_rank() == 0:
        t.save("run.trace.json")           # the compact trace `shardwise report` reads
        t.save_chrome("run.chrome.json")   # Perfetto / chrome://tracing

Spans come from the life-cycle events of ``shardwise.core.events`` (compute of each unit in each
pass, gathers, reshards, reductions) plus the optimizer's step. A communication span runs from
its issue to the moment the tracer first saw it complete: at the next life-cycle event, or at
the wait, whichever came first (an upper bound of the transfer's end).

Memory by category is sampled at every event, and the highest total between two samples is kept
too. Note [memory categories]: parameter shards, gathered parameters, gradients and optimizer
state are read from the tensors themselves (storage sizes of each unit's buffers, of every
``.grad`` and of the optimizer's state); activations are everything else that the traced code
allocated and still holds. On CPU, torch's profiler runs with memory profiling and no activity
(``allocations.Allocations``): the CPU allocator reports every allocation and free from C++,
so no Python runs per operator; when the trace ends, that log is replayed to give the bytes
alive at each sample and the highest total between samples, and activations are those bytes
minus the category storages that the trace allocated (told apart by address). On CUDA: the
caching allocator's ``memory_allocated`` minus the categories, and its peak counter between
samples, which the tracer resets. Under the planner (a fake world, fake tensors): the same
replay of a log that a dispatch mode keeps (``allocations.FakeAllocations``). It includes
autograd's saved tensors and short-lived temporaries such as activation gradients. Tensors
allocated before the trace began count only where they belong to a category (e.g. shards,
existing optimizer state).

Clocks: every rank passes a barrier on entry and counts time from there, so ranks line up to
within the barrier's skew.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from ..core import collectives as C
from ..core import events, groups
from ..core.collectives import comm_stats
from ..core.runtime import Phase, flat_tensors, runtime_of
from ..core.unit import ShardedUnit, Unit
from .accounting import dtype_name
from .allocations import Allocations, FakeAllocations

FORMAT = "shardwise-trace"
VERSION = 1
CATEGORIES = ("param_shards", "gathered", "gradients", "optimizer", "activations")


# id(storage) -> (category, storage, device type: the tensor's, as a fake tensor's storage is
# on the meta device)
Storages = dict[int, tuple[str, torch.UntypedStorage, str]]


def _in_flight(pending) -> list[torch.Tensor]:
    """The tensors a gather in flight holds: its receive rows, or, encoded on the wire, the
    messages it sends and receives (its rows are decoded only at the wait)."""
    return [] if pending is None else flat_tensors((pending.result, pending.buffers), [])


def _add(out: Storages, category: str, t: torch.Tensor | None) -> None:
    if t is not None and t.device.type != "meta":
        st = t.untyped_storage()
        out.setdefault(id(st), (category, st, t.device.type))


class _Known:
    """The storages of this rank's units and optimizer that belong to a memory category (see
    Note [memory categories]). What changes only at known points is summed when it changes:
    parameter shards never, optimizer state at its step, shard gradients when they land and
    at a step's start and end. Gathered buffers, reduction buffers and the gradients of a unit
    in backward are read at every sample."""

    def __init__(self, units: list[Unit], optimizer: torch.optim.Optimizer | None, runtime, log):
        self.units, self.optimizer, self.runtime, self.log = units, optimizer, runtime, log
        self.shards: Storages = {}
        for u in units:
            for p in [u.flat_shard] if isinstance(u, ShardedUnit) else u.params:
                _add(self.shards, "param_shards", p)
        self.opt: Storages = {}
        self.grads: dict[int, Storages] = {}
        # the sums of each part (shards, optimizer state, each unit's shard gradients)
        self.parts: dict[object, _Sums] = {"shards": _Sums(self.shards, log)}
        self.refresh()

    def refresh(self, unit: int | None = None) -> None:
        """Re-read shard gradients (of one unit, or all) and, for all, the optimizer state."""
        for i in range(len(self.units)) if unit is None else [unit]:
            u, g = self.units[i], {}
            for p in u.shard_params if isinstance(u, ShardedUnit) else u.params:
                _add(g, "gradients", p.grad)
            self.grads[i] = g
            self.parts[i] = _Sums(g, self.log)
        if unit is None and self.optimizer is not None:
            self.opt = {}
            for st in self.optimizer.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        _add(self.opt, "optimizer", v)
            self.parts["opt"] = _Sums(self.opt, self.log)
        parts = [self.shards, self.opt, *self.grads.values()]
        self.cached_ids = set().union(*parts)
        if len(self.cached_ids) == sum(map(len, parts)):  # disjoint: add up the parts' sums
            self.cached = _Sums()
            for part in self.parts.values():
                self.cached = self.cached.plus(part)
        else:  # a storage in two parts counts once
            cached: Storages = {}
            for part in parts:
                cached.update(part)
            self.cached = _Sums(cached, self.log)

    def dynamic(self) -> Storages:
        """The buffers that come and go within a step (those not summed in ``cached``)."""
        out: Storages = {}
        accumulating = not self.runtime.sync_grads
        for u in self.units:
            if isinstance(u, ShardedUnit):
                _add(out, "gathered", u.flat_full)  # the shard itself where a unit aliases it
                for row in _in_flight(u._gather):
                    if row.untyped_storage() is not u.flat_shard.untyped_storage():
                        _add(out, "gathered", row)  # the receive rows, not this rank's shard
                _add(out, "gathered", u._send)
                _add(out, "gradients", u._reduce_out)
                for row in u._reduce_rows.rows if u._reduce_rows is not None else ():  # CUDA: held in flight
                    _add(out, "gradients", row)
                for g in getattr(u, "_local_grads", None) or ():  # one rank: no reduction
                    _add(out, "gradients", g)
                if u.grads_ready or accumulating:  # full gradients exist only in backward
                    for p in u.full_params:
                        _add(out, "gradients", p.grad)
            else:
                if u.casts:
                    for c in u.full_params:
                        _add(out, "gathered", c)
                        _add(out, "gradients", c.grad)
                if u.grads_ready:
                    for p in u.params:
                        _add(out, "gradients", p.grad)
                _add(out, "gradients", u._bucket)
                _add(out, "gradients", u._flat_grad)  # no_shard's kept bucket, where it has one
        for key in self.cached_ids.intersection(out):
            del out[key]
        return out


class _Sums:
    """Bytes per device and category, and the addresses of the CPU storages among them
    (``blocks``: which of them the trace allocated is known only when its log is replayed),
    each passed to the log's ``watch``."""

    def __init__(self, storages: Storages | None = None, log=None):
        self.cats: dict[str, dict[str, int]] = {}
        self.blocks: list[int] = []
        for cat, st, dev in (storages or {}).values():
            n = st.nbytes()
            if dev not in self.cats:
                self.cats[dev] = dict.fromkeys(CATEGORIES, 0)
            self.cats[dev][cat] += n
            if dev == "cpu" and n and log is not None:
                key = log.key(st)
                self.blocks.append(key)
                log.watch(st, key)

    def plus(self, other: _Sums) -> _Sums:
        out = _Sums()
        for src in (self, other):
            for dev, c in src.cats.items():
                mine = out.cats.setdefault(dev, dict.fromkeys(CATEGORIES, 0))
                for k, v in c.items():
                    mine[k] += v
        out.blocks = self.blocks + other.blocks
        return out


def _replay(
    samples: list[tuple[int, float, dict[str, dict[str, int]], list[int]]],
    log: list[tuple[int, int, int, int]],
) -> list[list]:
    """The CPU memory rows: each sample's categories with activations, and the highest total
    since the previous sample, from the allocator's log (see Note [memory categories])."""
    live: dict[int, tuple[int, int]] = {}  # address -> (bytes, time) of a block of the trace
    total, i, base_before, rows = 0, 0, None, []
    for t_ns, rel, cats, blocks in samples:
        high = total
        while i < len(log) and log[i][0] <= t_ns:
            t, ptr, n, seen = log[i]
            i += 1
            if n > 0:  # an address still alive here was freed on a thread the log misses
                total += n - live.get(ptr, (0, 0))[0]
                live[ptr] = (n, t)
                high = max(high, total)
            elif n < 0:
                total -= live.pop(ptr, (0, 0))[0]
            elif ptr in live and live[ptr][1] <= seen:  # a watched storage freed: its block
                total -= live.pop(ptr)[0]
        tracked = sum(live[ptr][0] for ptr in set(blocks) if ptr in live)
        d = cats.setdefault("cpu", dict.fromkeys(CATEGORIES, 0))
        d["activations"] = total - tracked
        base = sum(d.values()) - total  # category bytes allocated before the trace
        base_before = base if base_before is None else base_before
        rows.append(
            [rel, "cpu", *(d[c] for c in CATEGORIES), max(high + base_before, total + base)]
        )
        base_before = base
        for dev, other in sorted(cats.items()):
            if dev not in ("cpu", "meta"):
                rows.append([rel, dev, *(other[c] for c in CATEGORIES), sum(other.values())])
    return rows


class Trace:
    """Records this rank's events and memory while entered; on exit every rank's record is
    gathered, so ``data`` (the compact trace) is complete on every rank. Entering and leaving
    are collective: every rank must do both."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        on_event: Callable[[list], None] | None = None,
    ):
        self.runtime = runtime_of(model)
        self._on_recorded = on_event
        self.model, self.optimizer = model, optimizer
        self.units = self.runtime.units
        self.index = {u.label: i for i, u in enumerate(self.units)}
        self.data: dict | None = None
        self._events: list[list] = []
        self._memory: list[list] = []
        self._steps: list[list[float]] = []
        self._device = groups.device()
        # in a fake world (the planner) this process stands for rank 0 alone, on fake tensors
        self._fake = dist.get_backend() == "fake"
        # Note [memory categories]: on CUDA the allocator's counters, on CPU its log
        self._log = (
            FakeAllocations() if self._fake else Allocations() if self._device.type != "cuda" else None
        )
        self._pending: list = []  # CPU samples, completed from the log at the end
        self._handles = []
        self._flight: dict[int, tuple[str, int, object]] = {}  # id(Pending) -> stream, unit, it
        self._t0 = 0.0

    # --- recording
    def __enter__(self) -> Trace:
        if dist.get_world_size() > 1 and not self._fake:
            C.blocking("barrier", "trace start", dist.barrier)
        self._t0 = time.perf_counter()
        self._comm0 = comm_stats()
        self._handles.append(self.model.register_forward_pre_hook(self._on_root_forward, prepend=True))
        root = self.units[-1]
        self._root_silent = not (isinstance(root, ShardedUnit) or root.casts)
        if self._root_silent:  # no_shard runs no forward hooks of its own (like DDP): mark its forward
            self._handles.append(self.model.register_forward_hook(self._on_root_forward_end))
        if self.optimizer is not None:
            self._handles += [
                self.optimizer.register_step_pre_hook(lambda *a: self._event("optimizer", -1, edge="begin")),
                self.optimizer.register_step_post_hook(lambda *a: self._event("optimizer", -1, edge="end")),
            ]
        self._known = _Known(self.units, self.optimizer, self.runtime, self._log)
        if self._log is not None:
            self._log.start()
        else:
            torch.cuda.reset_peak_memory_stats(self._device)
        events.listen(self._on_event)
        self._sample(time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        events.unlisten(self._on_event)
        try:
            self._known.refresh()  # e.g. gradients freed by zero_grad since the last event
            if self._log is not None:
                self._log.settle(self._known.cached_ids | set(self._known.dynamic()))
            self._sample(time.perf_counter())
        finally:
            log = self._log.stop() if self._log is not None else None
            self._flight.clear()
            for h in self._handles:
                h.remove()
        if log is not None:
            self._memory, self._pending = _replay(self._pending, log), []
        if self._steps:
            self._steps[-1][1] = self._rel(time.perf_counter())
        if exc[0] is None:
            self.data = self._gather()

    def _rel(self, t: float) -> float:
        return round(t - self._t0, 7)

    def _on_root_forward(self, module, args) -> None:
        if torch.is_grad_enabled() and self.runtime.phase is not Phase.BACKWARD:
            self._event("step_begin", -1)
            if self._root_silent:
                self._event("forward", len(self.units) - 1, edge="begin")

    def _on_root_forward_end(self, module, args, output) -> None:
        if torch.is_grad_enabled():
            self._event("forward", len(self.units) - 1, edge="end")

    def _event(self, name: str, unit: int, **fields) -> None:
        self._record(name, unit, time.perf_counter(), fields)

    def _on_event(self, name: str, unit: str, t: float, **fields) -> None:
        i = self.index.get(unit, -1)
        if i < 0 and name == "collective" and fields["kind"] == "replicate_all_reduce":
            bucket = next((b for b in self.runtime.buckets if b.label == unit), None)
            if bucket is not None:  # a bucket's one all-reduce: each member's part, as its own
                for u in bucket.trainable:
                    part = fields["bytes"] * u.grad_layout.sizes[0] // bucket.grad_numel
                    self._record(name, self.index[u.label], t, {**fields, "bytes": part})
                return
        self._record(name, i, t, fields)

    def _record(self, name: str, unit: int, t: float, fields: dict) -> None:
        rel = self._rel(t)
        if name == "step_begin" or (not self._steps and name != "optimizer"):
            if self._steps:
                self._steps[-1][1] = rel
            self._steps.append([rel, rel])
            if name == "step_begin":
                self._known.refresh()
                return
        if name in ("optimizer", "step_end"):
            self._known.refresh()
        elif name == "reduce_done":
            self._known.refresh(unit)
        ev = [rel, name, unit]
        if name in ("forward", "backward", "optimizer"):
            ev.append(fields["edge"])
        elif name in ("gather_issue", "reduce_issue"):
            ev.append(fields["bytes"])
        elif name == "collective":
            ev += [fields["kind"], fields["bytes"], self._rel(fields["t_issue"]), round(fields["wait_s"], 7)]
        self._append(ev)
        if name in ("gather_issue", "reduce_issue") and unit >= 0:
            p = getattr(self.units[unit], "_gather" if name == "gather_issue" else "_reduce", None)
            if p is not None:
                self._flight[id(p)] = (name.split("_")[0], unit, p)
                if self._log is not None:  # (see allocations.Allocations.watch_buffers)
                    self._log.watch_buffers(_in_flight(p))
        self._poll(rel)
        self._sample(t)

    def _poll(self, rel: float) -> None:
        """Note the collectives that completed since the last event (see the module doc)."""
        for key, (stream, unit, p) in list(self._flight.items()):
            if p.completed():
                del self._flight[key]
                self._append([rel, stream + "_complete", unit])

    def _append(self, ev: list) -> None:
        self._events.append(ev)
        if self._on_recorded is not None:
            self._on_recorded(ev)

    def _sample(self, t: float) -> None:
        """One memory sample per device: categories, and the peak total since the last one."""
        if self._log is not None:  # CPU: activations and peak once the log is read
            now = self._log.now()
            sums = self._known.cached.plus(_Sums(self._known.dynamic(), self._log))
            self._pending.append((now, self._rel(t), sums.cats, sums.blocks))
            return
        sums = self._known.cached.plus(_Sums(self._known.dynamic()))
        dev = self._device  # CUDA: the caching allocator counts every tensor of the device
        total = torch.cuda.memory_allocated(dev)
        peak = max(torch.cuda.max_memory_allocated(dev), total)
        torch.cuda.reset_peak_memory_stats(dev)
        rel = self._rel(t)
        for name, d in sorted(sums.cats.items()):
            if name == "cuda":
                d["activations"] = max(0, total - sum(d.values()))
            if name != "meta":
                high = peak if name == "cuda" else sum(d.values())
                self._memory.append([rel, name, *(d[c] for c in CATEGORIES), high])

    # --- results
    def _gather(self) -> dict:
        comm = {  # what the traced steps added to each kind's totals
            k: {f: round(getattr(v, f) - getattr(self._comm0[k], f), 7) for f in asdict(v)}
            for k, v in comm_stats().items()
        }
        mine = {
            "rank": dist.get_rank(),
            "events": self._events,
            "memory": self._memory,
            "steps": self._steps,
            "comm": comm,
        }
        world = dist.get_world_size()
        ranks = [None] * world
        if world > 1 and not self._fake:
            C.blocking("all_gather", "trace results", dist.all_gather_object, ranks, mine)
        else:
            ranks = [mine]
        mesh = self.runtime.mesh
        return {
            "format": FORMAT,
            "version": VERSION,
            "world_size": world,
            "strategy": self.runtime.sharding.value,
            # (replicas, shard group size): gathers and reduce-scatters run within a shard
            # group, hybrid sharding's replicate all-reduces across them
            "mesh": {
                "replicate": dist.get_world_size(mesh.replicate) if mesh.replicate is not None else 1,
                "shard": dist.get_world_size(mesh.shard),
            },
            "precision": {
                "param_dtype": dtype_name(self.runtime.precision.param_dtype),
                "reduce_dtype": dtype_name(self.runtime.precision.reduce_dtype),
            },
            "cpu_offload": any(getattr(u, "offloaded", False) for u in self.units),
            "categories": list(CATEGORIES),
            "units": [_unit_info(u) for u in self.units],
            "ranks": ranks,
        }

    def _require(self) -> dict:
        if self.data is None:
            raise RuntimeError("the trace is complete only after its `with` block has ended")
        return self.data

    def save(self, path: str | Path) -> Path:
        """Write the compact trace (the input of ``shardwise report``)."""
        return _write(path, json.dumps(self._require(), separators=(",", ":")))

    def save_chrome(self, path: str | Path) -> Path:
        """Write the trace in Chrome's trace event format (Perfetto, chrome://tracing)."""
        return _write(path, json.dumps(to_chrome(self._require())))


def _write(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def trace(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    on_event: Callable[[list], None] | None = None,
) -> Trace:
    """Record, on every rank, each unit's gathers, reshards, reductions and compute and the
    memory held by category, for as long as the returned context is entered.

    ``model`` is a model that ``shardwise.shard()`` returned; with ``optimizer`` its step is
    traced and its state counted. ``on_event(event)`` is called with each event as it is
    recorded (the compact form ``[t, name, unit, ...]`` that the trace keeps), on this rank's
    thread, before the run goes on: a live view (``shardwise explore``) streams them from
    there. Nothing is installed outside the ``with`` block, so a run that is not traced pays
    nothing. Entering and leaving are collective calls.
    """
    return Trace(model, optimizer, on_event)


def _unit_info(u: Unit) -> dict:
    if isinstance(u, ShardedUnit):
        item = u.compute_dtype.itemsize
        return {
            "name": u.label,
            "kind": "sharded",
            "dtype": dtype_name(u.flat_shard.dtype),
            "params": u.layout.numel,
            "trained": u.num_trainable,
            "shard_bytes": u.flat_shard.nbytes,
            "gathered_bytes": u.layout.unsharded_numel * item,
            "owned": [[s.name, s.owner, s.numel * u.flat_shard.element_size()] for s in u.layout.slots if s.owned],
        }
    numel = sum(p.numel() for p in u.params)
    return {
        "name": u.label,
        "kind": "replicated",
        "dtype": dtype_name(u.params[0].dtype) if u.params else "float32",
        "params": numel,
        "trained": u.num_trainable,
        "shard_bytes": sum(p.nbytes for p in u.params),
        "gathered_bytes": numel * u.compute_dtype.itemsize if u.casts else 0,
    }


# --- reading a trace
def load(path: str | Path) -> dict:
    """Read a compact trace, checking that it is one."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a shardwise trace (write one with shardwise.trace(...).save())")
    if data.get("version") != VERSION:
        raise ValueError(f"{path} is a version {data.get('version')} trace; this shardwise reads {VERSION}")
    return data


def spans(rank: dict, units: list[dict]) -> list[dict]:
    """Every span of one rank: compute (forward/backward of a unit, the optimizer step) and
    communication (gather, reduce; with hybrid sharding, replicate: the all-reduce of a unit's
    reduced shard across the replicas, from its issue to its wait), each with start, end,
    track and label."""
    out: list[dict] = []
    open_compute: dict[tuple[str, int], float] = {}
    issued: dict[tuple[str, int], list] = {}
    end = rank["steps"][-1][1] if rank["steps"] else 0.0

    def name(i: int) -> str:
        return units[i]["name"] if i >= 0 else ""

    for ev in rank["events"]:
        t, kind, unit = ev[0], ev[1], ev[2]
        if kind in ("forward", "backward", "optimizer"):
            key = (kind, unit)
            if ev[3] == "begin":
                open_compute[key] = t
            elif key in open_compute:
                out.append(_span("compute", kind, name(unit), open_compute.pop(key), t))
        elif kind == "step_end":
            for (k, u), t0 in list(open_compute.items()):  # the root's backward ends here
                if k == "backward":
                    out.append(_span("compute", k, name(u), t0, t))
                    del open_compute[(k, u)]
        elif kind in ("gather_issue", "reduce_issue"):
            stream = kind.split("_")[0]
            issued.setdefault((stream, unit), []).append([t, None, ev[3], None])
        elif kind in ("gather_complete", "reduce_complete"):
            _close(issued, (kind.split("_")[0], unit), t)
        elif kind == "collective" and ev[3] == "replicate_all_reduce":
            out.append(_span("replicate", "all_reduce", name(unit), ev[5], t, bytes=ev[4], wait=ev[6]))
        elif kind == "collective" and ev[3] in _STREAM:
            _close(issued, (_STREAM[ev[3]], unit), t, wait=ev[6])
    for (stream, unit), items in issued.items():
        for t0, t1, nbytes, wait in items:
            t1 = t1 if t1 is not None else end
            out.append(_span(stream, stream, name(unit), t0, t1, bytes=nbytes, wait=wait or 0.0))
    for (k, u), t0 in open_compute.items():
        out.append(_span("compute", k, name(u), t0, end))
    out.sort(key=lambda s: (s["start"], -s["end"]))
    return out


# the stream whose span a collective's wait closes
_STREAM = {"all_gather": "gather", "reduce_scatter": "reduce", "all_reduce": "reduce"}


def _span(track: str, kind: str, unit: str, start: float, end: float, **extra) -> dict:
    return {"track": track, "kind": kind, "unit": unit, "start": start, "end": max(start, end), **extra}


def _close(issued: dict, key: tuple[str, int], t: float, wait: float | None = None) -> None:
    """Give the earliest open (or waiting) span of ``key`` its end and, at the wait, its wait."""
    for item in issued.get(key, []):
        if wait is not None and item[3] is None:
            item[1] = t if item[1] is None else min(item[1], t)
            item[3] = wait
            return
        if wait is None and item[1] is None:
            item[1] = t
            return


def when(rank: dict, units: list[dict], device: str = "cpu") -> tuple[list[str], list[str]]:
    """For each memory sample of ``device`` in one rank's record: what ran since the sample
    before it (e.g. "backward of blocks.2"; a unit's gather counts as its own) and the stage of
    its step: forward, backward (from the root's forward end: the loss is backward's),
    optimizer, or after."""
    root = units[-1]["name"]
    events = sorted(rank["events"], key=lambda e: e[0])
    running: list[str] = []  # compute spans open, innermost last
    stage, k, began, ended = "forward", 0, False, False
    idle = {"forward": "forward", "optimizer": "optimizer step", "after": "after the step"}
    labels, stages = [], []
    for sample in rank["memory"]:
        if sample[1] != device:
            continue
        stages.append(stage)
        labels.append(
            running[-1]
            if running
            else idle.get(stage)
            or ("end of backward" if ended else "backward" if began else "loss, start of backward")
        )
        while k < len(events) and events[k][0] <= sample[0]:
            _, name, unit, *rest = events[k]
            k += 1
            who = units[unit]["name"] if unit >= 0 else ""
            span = f"{name} of {who}"
            if name in ("forward", "backward") and rest[0] == "begin":
                if stage == "after":  # the next step
                    stage, began, ended = "forward", False, False
                running.append(span)
                labels[-1], began = span, began or name == "backward"
            elif name in ("forward", "backward") and span in running:
                running.remove(span)
                stage = "backward" if span == f"forward of {root}" else stage
            elif name == "reduce_issue":  # (no_shard runs no backward hooks)
                began = True
            elif name == "gather_done":
                labels[-1] = f"{'backward' if began else 'forward'} gather of {who}"
            elif name == "step_end":
                running, ended = [], True
            elif name == "optimizer":
                stage = "optimizer" if rest[0] == "begin" else "after"
                running = ["optimizer step"] if rest[0] == "begin" else []
    return labels, stages


def lanes(track_spans: list[dict]) -> int:
    """Give each span of one track a ``lane`` so that spans in a lane never overlap (a
    reduction issued while another is in flight goes one lane down); returns how many."""
    ends: list[float] = []
    for s in sorted(track_spans, key=lambda s: s["start"]):
        lane = next((i for i, e in enumerate(ends) if e <= s["start"]), len(ends))
        if lane == len(ends):
            ends.append(s["end"])
        ends[lane] = s["end"]
        s["lane"] = lane
    return max(1, len(ends))


def to_chrome(data: dict) -> dict:
    """The trace in Chrome's trace event format: one process per rank; one thread for compute
    and one per lane of each communication stream (see ``lanes``); complete events in
    microseconds; memory counters per device."""
    names = {
        "compute": "compute",
        "gather": "all-gather",
        "reduce": "reduce-scatter / all-reduce",
        "replicate": "all-reduce across replicas",
    }
    base = {"compute": 0, "gather": 100, "reduce": 200, "replicate": 300}
    out = []
    for r in data["ranks"]:
        pid = r["rank"]
        out += _names(pid, None, f"rank {pid}", pid)
        every = spans(r, data["units"])
        for track in names:
            mine = [s for s in every if s["track"] == track]
            if track == "replicate" and not mine:  # hybrid sharding only
                continue
            for lane in range(lanes(mine) if track != "compute" else 1):
                label = names[track] + (f" ({lane + 1})" if lane else "")
                out += _names(pid, base[track] + lane, label, base[track] + lane)
        for s in every:
            label = f"{s['kind']} {s['unit']}".strip()
            ev = {
                "ph": "X",
                "pid": pid,
                "tid": base[s["track"]] + s.get("lane", 0),
                "name": label,
                "cat": s["track"],
                "ts": round(s["start"] * 1e6, 3),
                "dur": round((s["end"] - s["start"]) * 1e6, 3),
            }
            if "bytes" in s:
                ev["args"] = {"bytes": s["bytes"], "blocked_us": round(s["wait"] * 1e6, 3)}
            out.append(ev)
        for t, dev, *values, _peak in r["memory"]:
            mib = {c: round(v / 2**20, 4) for c, v in zip(data["categories"], values)}
            out.append({"ph": "C", "pid": pid, "name": f"memory {dev} (MiB)", "ts": round(t * 1e6, 3), "args": mib})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def _names(pid: int, tid: int | None, name: str, index: int) -> list[dict]:
    """Chrome's metadata events naming and ordering a process (``tid`` None) or a thread."""
    kind, at = ("process", {}) if tid is None else ("thread", {"tid": tid})
    return [
        {"ph": "M", "pid": pid, **at, "name": f"{kind}_name", "args": {"name": name}},
        {"ph": "M", "pid": pid, **at, "name": f"{kind}_sort_index", "args": {"sort_index": index}},
    ]


def summary(data: dict) -> list[dict]:
    """Per rank and device: the measured peak (highest total at any allocation), the
    categories at the sample where the total was highest, and the model state (parameter
    shards, gradients and optimizer state) at its highest at a step's end."""
    cats = data["categories"]
    out = []
    for r in data["ranks"]:
        by_dev: dict[str, dict] = {}
        ends = {e[0] for e in r["events"] if e[1] == "step_end"}
        top: dict[str, int] = {}  # the highest sampled total per device
        for t, dev, *values, peak in r["memory"]:
            d = by_dev.setdefault(dev, {"rank": r["rank"], "device": dev, "peak": 0, "at_peak": None, "model_state": 0})
            v, total = dict(zip(cats, values)), sum(values)
            d["peak"] = max(d["peak"], peak, total)
            if total > top.get(dev, -1):
                top[dev], d["at_peak"] = total, v
            if t in ends:
                d["model_state"] = max(d["model_state"], v["param_shards"] + v["gradients"] + v["optimizer"])
        out += by_dev.values()
    return out
