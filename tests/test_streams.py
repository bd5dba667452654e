"""The CUDA stream design, checked without a GPU: a stand-in for ``torch.cuda`` records every
wait and event, the units take their CUDA branch on Gloo, and the log must keep the rules of
Note [stream ordering] while training matches the CPU branch exactly."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from nets import batch, local_slice, loss_of, make, wrap_policy

import shardwise
from shardwise.core import events
from shardwise.core.streams import Streams, for_device
from shardwise.core.unit import ShardedUnit


class _Event:
    def __init__(self, device: _Device, stream: str):
        self.device, self.stream, self.id = device, stream, len(device.events)
        device.events.append(self)

    def synchronize(self) -> None:
        self.device.log.append(("synchronize", "cpu", self.id))


class _Stream:
    def __init__(self, device: _Device, name: str):
        self.device, self.name = device, name

    def wait_stream(self, other: _Stream) -> None:
        self.device.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: _Event) -> None:
        self.device.log.append(("wait_event", self.name, event.id))

    def record_event(self) -> _Event:
        event = _Event(self.device, self.name)
        self.device.log.append(("record", self.name, event.id))
        return event


class _Device:
    """Stands in for ``torch.cuda``: streams that log what is asked of them."""

    def __init__(self):
        self.log: list[tuple] = []
        self.events: list[_Event] = []
        self.current = _Stream(self, "compute")
        self._names = iter(["copy_in", "gather", "reduce"])

    def Stream(self, device, priority=0):  # as torch.cuda.Stream
        return _Stream(self, next(self._names))

    def current_stream(self) -> _Stream:
        return self.current

    @contextlib.contextmanager
    def stream(self, s: _Stream):
        prev, self.current = self.current, s
        try:
            yield
        finally:
            self.current = prev


def train(strategy, mp, offload, on_streams, steps=2):
    hybrid = {"shard_size": 2} if strategy.startswith("hybrid") else {}
    model = shardwise.shard(
        make("tied"), wrap=wrap_policy("by_class", "tied"), strategy=strategy,
        mixed_precision=mp, cpu_offload=offload, **hybrid,
    )
    units = {u.label: u for u in shardwise.units(model)}
    device = _Device()
    if on_streams:
        streams = Streams(torch.device("cpu"), device_module=device)
        for u in units.values():
            u.streams = streams
    held = []  # (event, unit, what the unit holds at that moment)

    def listen(name, unit, **fields):
        u = units.get(unit)
        device.log.append(("event", name, unit, fields.get("kind"), device.current.name))
        if isinstance(u, ShardedUnit) and name in ("gather_issue", "gather_done", "reduce_issue", "reduce_done"):
            held.append((name, unit, u._gather is not None, u._reduce_rows is not None))

    events.listen(listen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    try:
        for step in range(steps):
            x, y = batch("tied", step, 2 * dist.get_world_size())
            loss = loss_of(model, local_slice(x), local_slice(y))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        events.unlisten(listen)
    full = shardwise.full_state_dict(model, rank0_only=False)
    return losses, full, device.log, held


def _check_rules(log, held, offload):
    """Note [stream ordering] on one rank's log; returns how many gathers and reductions."""
    side = {"copy_in", "gather", "reduce"}
    waited = {}  # event id -> index where compute waited on it
    synced = set()
    recorded = {}  # event id -> (stream, unit of the collective before it)
    last_collective = {}  # stream -> unit label
    fresh = dict.fromkeys(side, False)  # a side stream waited for compute since its last work
    counts = {"all_gather": 0, "reduce_scatter": 0, "replicate_all_reduce": 0}
    for i, entry in enumerate(log):
        kind = entry[0]
        if kind == "wait_stream":
            _, stream, other = entry
            if other == "compute":
                fresh[stream] = True  # rule 1
            elif other in side:  # through copy_in, which waited for compute
                fresh[stream], fresh[other] = fresh[other], False
        elif kind == "event" and entry[1] == "collective" and entry[3] == "replicate_all_reduce":
            _, _, unit, what, current = entry  # hybrid: after the reduce-scatter, on its stream
            assert current == "reduce" and last_collective.get("reduce") == unit, entry
            counts[what] += 1
        elif kind == "event" and entry[1] == "collective" and entry[3] in counts:
            _, _, unit, what, current = entry
            want = "gather" if what == "all_gather" else "reduce"
            assert current == want, f"{what} of {unit} issued on {current}"
            assert fresh[want], f"{what} of {unit}: its stream did not wait for compute first"
            fresh[want] = False
            last_collective[want] = unit
            counts[what] += 1
        elif kind == "record":
            _, stream, eid = entry
            recorded[eid] = (stream, last_collective.get(stream))
        elif kind == "wait_event":
            _, stream, eid = entry
            assert stream == "compute" and eid in recorded
            waited[eid] = i
        elif kind == "synchronize":
            synced.add(entry[2])
        elif kind == "event" and entry[1] in ("gather_done", "reduce_done"):
            unit, stream = entry[2], "gather" if entry[1] == "gather_done" else "reduce"
            mine = [e for e, (s, u) in recorded.items() if s == stream and u == unit]
            if mine:  # rule 2: compute waited on the unit's latest event before using it
                assert mine[-1] in waited, f"{entry[1]} of {unit} before compute waited"
                if offload and stream == "reduce":
                    assert mine[-1] in synced, f"{unit}: host gradients read before the copy"
    assert set(recorded) == set(waited), "an event compute never waited on"
    for name, unit, gathering, reducing in held:  # rule 3: buffers held exactly while in flight
        if name == "gather_issue":
            assert gathering, unit
        if name == "gather_done":
            assert not gathering, unit
        if name == "reduce_issue":
            assert reducing, unit
        if name == "reduce_done":
            assert not reducing, unit
    return counts


CONFIGS = [
    ("full_shard", None, False),
    ("shard_grad_op", "bf16", False),
    ("full_shard", None, True),
    ("hybrid_shard", None, False),  # at 2x2
]


@pytest.mark.parametrize("strategy,mp,offload", CONFIGS)
def test_stream_branch_keeps_the_ordering_rules_and_matches(pools, strategy, mp, offload):
    pool = pools(4 if strategy.startswith("hybrid") else 2)
    cpu = pool.run(train, strategy, mp, offload, False)
    gpu = pool.run(train, strategy, mp, offload, True)
    for (losses, full, _, _), (s_losses, s_full, log, held) in zip(cpu, gpu):
        assert losses == s_losses  # the same operations in the same order: bitwise
        for k, v in full.items():
            assert torch.equal(v, s_full[k]), k
        counts = _check_rules(log, held, offload)
        assert counts["all_gather"] >= 8 and counts["reduce_scatter"] >= 8  # 4 units, 2 steps
        assert counts["replicate_all_reduce"] == (8 if strategy.startswith("hybrid") else 0)
        assert not any(e[0] == "wait_event" for e in cpu[0][2])  # the CPU branch uses none


def test_streams_are_created_only_on_cuda():
    assert for_device(torch.device("cpu")) is None
    device = _Device()
    s = Streams(torch.device("cpu"), device_module=device)
    assert (s.copy_in.name, s.gather.name, s.reduce.name) == ("copy_in", "gather", "reduce")
    with s.use(s.gather):
        assert s.compute().name == "gather"
    assert s.compute().name == "compute"
