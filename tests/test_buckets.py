"""Buckets of small units (buckets.py): one gather and one reduce-scatter for consecutive small
units change nothing but the number of collectives: the same gradients, parameters and
checkpoints, bitwise, as every unit alone; units keep their names in events and records."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shardwise
from shardwise.core import events, flight
from shardwise.core.buckets import gathered_bytes


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)

    def forward(self, x):
        return x + torch.tanh(self.ln(self.lin(x)))


class Blocks(nn.Module):
    """Small blocks run in ``order`` (a permutation: the forward order can change between steps);
    ``skip``: a block not run at all."""

    def __init__(self, n: int = 6, d: int = 7):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 3)
        self.order = list(range(n))

    def forward(self, x):
        for i in self.order:
            x = self.blocks[i](x)
        return self.head(x)


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 7, generator=g), torch.randint(0, 3, (rows,), generator=g)


def _local(t: torch.Tensor) -> torch.Tensor:
    per = t.shape[0] // dist.get_world_size()
    return t[dist.get_rank() * per : (dist.get_rank() + 1) * per]


def train(
    bucket_bytes: int | None, strategy: str, precision, orders: list, steps: int = 4, offload: bool = False,
    shard_size: int | None = None,
):
    """SGD steps of ``Blocks`` (one forward order per step from ``orders``, cycled); returns
    per step each shard's gradient, the shards after the step, the buckets' members (by name),
    and the full state dict at the end, with the single-process reference's parameters."""
    torch.manual_seed(0)
    ref = Blocks()
    model = shardwise.shard(
        copy.deepcopy(ref), wrap=shardwise.wrap.by_class(Block), strategy=strategy, mixed_precision=precision,
        cpu_offload=offload, shard_size=shard_size,
    )
    rt = model._shardwise
    if bucket_bytes is not None:
        rt.bucket_bytes = bucket_bytes
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    per_step = []
    for step in range(steps):
        order = orders[step % len(orders)]
        model.order = ref.order = order
        x, y = _batch(step, 4 * dist.get_world_size())
        F.cross_entropy(model(_local(x)), _local(y)).backward()
        grads = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        buckets = [[u.label for u in b.units] for b in rt.buckets]
        per_step.append((grads, [p.detach().clone() for p in model.parameters()], buckets))
    full = shardwise.full_state_dict(model)
    return per_step, full, ref.state_dict()


ORDER = list(range(6))


def _compare(alone, bucketed, tolerance: float):
    """Every rank's gradients and shards bitwise equal; the full state dicts too; and both
    near the single-process reference."""
    for (steps_a, full_a, ref), (steps_b, full_b, _) in zip(alone, bucketed):
        for step, ((ga, pa, _), (gb, pb, _)) in enumerate(zip(steps_a, steps_b)):
            for a, b in zip(ga, gb):
                assert (a is None) == (b is None), f"step {step}"
                assert a is None or torch.equal(a, b), f"step {step}: gradients differ"
            assert all(torch.equal(a, b) for a, b in zip(pa, pb)), f"step {step}: shards differ"
        assert full_a.keys() == full_b.keys()  # (rank 0 holds the full state dict)
        assert full_a.keys() == ref.keys() or not full_a
        for k in full_a:
            assert torch.equal(full_a[k], full_b[k]), k
            assert torch.allclose(full_b[k], ref[k], atol=tolerance, rtol=0), k


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_bucketed_equals_alone_fp32(pools, world_size):
    alone = pools(world_size).run(train, 0, "full_shard", None, [ORDER])
    bucketed = pools(world_size).run(train, None, "full_shard", None, [ORDER])
    _compare(alone, bucketed, 1e-5)
    assert bucketed[0][1]  # rank 0 compared the full state dicts
    buckets = bucketed[0][0][-1][2]
    if world_size == 1:
        assert buckets == []  # nothing to coalesce on one rank
    else:  # after the first step: the six blocks in forward order, the root alone
        assert bucketed[0][0][0][2] == [[f"blocks.{i}" for i in ORDER]] == buckets
    assert alone[0][0][-1][2] == []


@pytest.mark.parametrize(
    "strategy,precision,offload", [("shard_grad_op", None, False), ("full_shard", "bf16", False), ("full_shard", "bf16", True)]
)
def test_bucketed_equals_alone_other_settings(pools, strategy, precision, offload):
    tolerance = 1e-5 if precision is None else 2e-2
    alone = pools(2).run(train, 0, strategy, precision, [ORDER], 4, offload)
    bucketed = pools(2).run(train, None, strategy, precision, [ORDER], 4, offload)
    _compare(alone, bucketed, tolerance)
    assert len(bucketed[0][0][-1][2]) == 1


@pytest.mark.parametrize("strategy,precision", [("hybrid_shard", None), ("hybrid_shard_grad_op", "bf16")])
def test_bucketed_hybrid_equals_alone(pools, strategy, precision):
    """2 shard groups of 2: each bucket's reduced shard is all-reduced across the 2 replicas in
    one collective, bitwise what each unit's own all-reduce gives (two values per element)."""
    tolerance = 1e-5 if precision is None else 2e-2
    alone = pools(4).run(train, 0, strategy, precision, [ORDER], 4, False, 2)
    bucketed = pools(4).run(train, None, strategy, precision, [ORDER], 4, False, 2)
    _compare(alone, bucketed, tolerance)
    assert bucketed[0][0][-1][2] == [[f"blocks.{i}" for i in ORDER]]
    kinds = pools(4).run(_replicate_all_reduces, strategy)
    assert kinds[0] == (1 + 1, 6 + 1), kinds  # per step: a bucket's and the root's; else one per unit


def _replicate_all_reduces(strategy: str) -> tuple[int, int]:
    """The all-reduces across replicas of one step, bucketed and with every unit alone."""
    counts = []
    for bucket_bytes in (None, 0):
        torch.manual_seed(0)
        model = shardwise.shard(Blocks(), wrap=shardwise.wrap.by_class(Block), strategy=strategy, shard_size=2)
        if bucket_bytes is not None:
            model._shardwise.bucket_bytes = bucket_bytes
        x, y = _batch(0, 4 * dist.get_world_size())
        for _ in range(2):  # the first step has no order to bucket from
            start = flight._seq
            F.cross_entropy(model(_local(x)), _local(y)).backward()
        counts.append(sum(r.kind == "replicate_all_reduce" for r in flight._ring if r.seq >= start))
    return tuple(counts)


def test_order_change_rebuckets(pools):
    """A forward order that changes makes the buckets again, from the new order; a bucket
    whose member is not run completes its reduction without it (its gradient stays None); a
    member called twice is gathered again with its bucket."""
    reversed_, skipping, twice = ORDER[::-1], [0, 1, 3, 4, 5], [0, 1, 2, 0, 3, 4, 5]
    orders = [ORDER, reversed_, skipping, twice, ORDER]
    alone = pools(2).run(train, 0, "full_shard", None, orders, steps=5)
    bucketed = pools(2).run(train, None, "full_shard", None, orders, steps=5)
    _compare(alone, bucketed, 1e-5)
    made = [b for _, _, b in bucketed[0][0]]
    firsts = [list(dict.fromkeys(order)) for order in orders]
    assert made == [[[f"blocks.{i}" for i in order]] for order in firsts]
    # step 3 ran without blocks.2 in buckets made from step 2's order: it got no gradient
    grads_step3 = bucketed[0][0][2][0]
    assert any(g is None for g in grads_step3)


def recorded(bucket_bytes: int | None):
    """Events and flight records of the second step (the first makes the buckets)."""
    torch.manual_seed(0)
    model = shardwise.shard(Blocks(), wrap=shardwise.wrap.by_class(Block))
    if bucket_bytes is not None:
        model._shardwise.bucket_bytes = bucket_bytes
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []

    def listen(name, unit, t, **fields):
        seen.append((name, unit, fields.get("kind")))

    for step in range(2):
        if step == 1:
            events.listen(listen)
            shardwise.reset_comm_stats()
        x, y = _batch(step, 8)
        F.cross_entropy(model(_local(x)), _local(y)).backward()
        opt.step()
        opt.zero_grad()
    events.unlisten(listen)
    calls = {k: s.calls for k, s in shardwise.comm_stats().items() if k in ("all_gather", "reduce_scatter")}
    return seen, [(r.kind, r.label) for r in flight._ring][-6:], calls


def test_units_keep_their_names(pools):
    """Every member still gathers, reshards and reduces under its own name in events; the
    bucket's collectives name its first and last unit; one gather in forward, one in backward
    and one reduce-scatter serve the six blocks."""
    seen, records, calls = pools(2).run(recorded, None)[0]
    seen_alone, _, calls_alone = pools(2).run(recorded, 0)[0]
    for name in ("gather_issue", "gather_done", "reshard", "reduce_issue", "reduce_done"):
        units = {u for n, u, _ in seen if n == name}
        assert {f"blocks.{i}" for i in range(6)} <= units, name
        assert sorted(u for n, u, _ in seen if n == name) == sorted(u for n, u, _ in seen_alone if n == name)
    label = "blocks.0 .. blocks.5 (6 units)"
    assert ("all_gather", label) in records and ("reduce_scatter", label) in records
    assert {u for n, u, k in seen if n == "collective"} == {label, "<root>", "<step check>"}
    # the root gathers once (kept through backward), the bucket twice; one reduce-scatter each
    assert calls == {"all_gather": 3, "reduce_scatter": 2}
    assert calls_alone == {"all_gather": 13, "reduce_scatter": 7}


def bounded(blocks: int):
    """The buckets' sizes and the most units unsharded at once in a step, with buckets of at
    most ``blocks`` blocks' gathered bytes."""
    torch.manual_seed(0)
    model = shardwise.shard(Blocks(n=8), wrap=shardwise.wrap.by_class(Block))
    model._shardwise.bucket_bytes = blocks * gathered_bytes(shardwise.units(model)[0])
    for step in range(2):
        x, y = _batch(step, 8)
        F.cross_entropy(model(_local(x)), _local(y)).backward()
    return [len(b.units) for b in model._shardwise.buckets], model._shardwise.peak_unsharded


def test_bucket_bounds_memory(pools):
    """A bucket holds at most ``bucket_bytes`` of gathered parameters: a cap of three blocks'
    makes buckets of three (the last of two), and no more than two of them are gathered at
    once (``max_unsharded``, a bucket counting as one unit; bytes: the test below)."""
    sizes, peak = pools(2).run(bounded, 3)[0]
    assert sizes == [3, 3, 2]
    assert peak == 2


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
def test_unit_called_again_after_a_call_without_gradient_inputs(pools, strategy):
    """A unit whose first call's inputs need no gradient (the batch) and that is called again
    later reduces once both calls' backward is done (it reduced after the later call's, and
    the first call's gradients were lost)."""
    twice = [0, 1, 2, 0, 3, 4, 5]
    ((_, full, ref),) = pools(1).run(train, None, strategy, None, [twice], steps=2)
    for k in ref:
        assert torch.allclose(full[k], ref[k], atol=1e-6, rtol=0), k


def _eight():
    return Blocks(n=8)


def _inputs():
    return torch.zeros(4, 7), torch.zeros(4, dtype=torch.long)


def _loss(model, x, y):
    return F.cross_entropy(model(x), y)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def traced_gathered(strategy: str, cap: int):
    """A real step's most gathered bytes at one moment (the tracer's; the second step: the
    first makes the buckets) with buckets of at most ``cap`` gathered bytes, the most units
    gathered at once, and the units' (name, gathered bytes)."""
    from shardwise.observer import trace as T

    torch.manual_seed(0)
    model = shardwise.shard(_eight(), wrap=shardwise.wrap.by_class(Block), strategy=strategy)
    model._shardwise.bucket_bytes = cap
    opt = _sgd(model.parameters())

    def step():
        x, y = _inputs()
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with T.trace(model, opt) as t:
        step()
    rank, cats = t.data["ranks"][dist.get_rank()], t.data["categories"]
    gathered = max(m[2 + cats.index("gathered")] for m in rank["memory"] if m[1] == "cpu")
    sizes = [len(b.units) for b in model._shardwise.buckets]
    return gathered, model._shardwise.peak_unsharded, sizes, {u["name"]: u["gathered_bytes"] for u in t.data["units"]}


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
@pytest.mark.parametrize("blocks", [3, 8])
def test_bucket_memory_planned_to_the_byte(pools, monkeypatch, strategy, blocks):
    """A bucket gathers its members at once and holds its rows until the last has copied its
    part out: the gathered peak counts the whole bucket, the planner (which runs the same
    runtime on fake tensors) predicts it to the byte, and ``max_unsharded`` counts a bucket as
    one unit. Buckets of three blocks and of all eight."""
    from shardwise.planner import plan as P

    block = 4 * 80  # a block's gathered bytes: its 70 parameters padded to whole rows on 2 ranks, fp32
    monkeypatch.setattr(shardwise.core.buckets, "BUCKET_BYTES", blocks * block)
    e = P.plan(
        _eight, world_size=2, strategy=strategy, wrap=shardwise.wrap.by_class(Block), inputs=_inputs,
        loss=_loss, backend="gloo", optimizer=_sgd,
    ).estimates[0]
    for gathered, peak_units, sizes, units in pools(2).run(traced_gathered, strategy, blocks * block):
        assert gathered == e.gathered_peak  # to the byte
        assert units["blocks.0"] == block and {u.name: u.gathered_bytes for u in e.units} == units
        assert sizes == {3: [3, 3, 2], 8: [8]}[blocks]
        if strategy == "full_shard":  # the root, the largest bucket's rows and one member's full buffer, at least
            assert units["<root>"] + max(sizes) * block + block <= gathered
            assert peak_units <= 2  # max_unsharded: a bucket counts once
        else:  # every block is held from forward to backward; the last bucket's rows until its last copy-out
            assert units["<root>"] + 7 * block + sizes[-1] * block <= gathered
