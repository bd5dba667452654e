"""What each rank holds and sends, accumulation, clipping, state dicts and deferred init."""

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from nets import batch, local_slice, loss_of, make, train_pair, wrap_policy

import shardwise
from shardwise.core.unit import ReplicatedUnit, ShardedUnit


# --- memory: shards are 1/N plus padding; full_shard keeps at most the limit gathered
def held_per_rank(strategy):
    model = shardwise.shard(make("tied"), wrap=wrap_policy("by_class", "tied"), strategy=strategy)
    model._shardwise.bucket_bytes = 0  # each unit alone: the limit counts units (buckets: test_buckets.py)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = []

    def watch(module, args, output):
        states = shardwise.unit_states(model)
        seen.append(sum(s != "SHARDED" for name, s in states.items() if name != "<root>"))

    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(watch)
    for step in range(2):
        x, y = batch("tied", step, 2 * dist.get_world_size())
        loss_of(model, local_slice(x), local_slice(y)).backward()
        opt.step()
        opt.zero_grad()
    param_elems = sum(p.numel() for p in model.parameters())
    flat_elems = sum(u.flat_shard.numel() for u in shardwise.units(model) if isinstance(u, ShardedUnit))
    padding = sum(
        s.rows_per_rank * s.row_numel * u.world - s.numel
        for u in shardwise.units(model) if isinstance(u, ShardedUnit) for s in u.layout.slots
    )
    state_elems = sum(
        t.numel() for st in opt.state.values() for k, t in st.items() if k in ("exp_avg", "exp_avg_sq")
    )
    return param_elems, flat_elems, padding, state_elems, max(seen), model._shardwise.peak_unsharded


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_memory_is_one_nth_plus_padding(pools, world_size):
    total = sum(p.numel() for p in make("tied").parameters())
    results = pools(world_size).run(held_per_rank, "full_shard")
    assert sum(r[0] for r in results) == total  # every element lives on exactly one rank
    for param_elems, flat_elems, padding, state_elems, seen_max, peak in results:
        assert flat_elems == (total + padding) // world_size  # the flat shard: 1/N plus padding
        assert param_elems <= flat_elems
        assert state_elems == 2 * param_elems  # Adam's two moments, sharded like the params
        assert seen_max <= 2 and peak <= 2  # never more than max_unsharded blocks gathered
        assert seen_max == 2  # and prefetch did overlap one block ahead


# --- communication: bytes per step equal the theory exactly
def comm_per_step(strategy, steps=3):
    model = shardwise.shard(make("tied"), wrap=wrap_policy("by_class", "tied"), strategy=strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = dist.get_world_size()
    for step in range(steps + 1):  # the first step learns the orders
        if step == 1:
            shardwise.reset_comm_stats()
        x, y = batch("tied", step, 2 * n)
        loss_of(model, local_slice(x), local_slice(y)).backward()
        opt.step()
        opt.zero_grad()
    stats = shardwise.comm_stats()
    expected = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    for u in shardwise.units(model):
        if isinstance(u, ShardedUnit):
            gathers = 2 if strategy == "full_shard" and not u.is_root else 1
            expected["all_gather"] += gathers * (u.layout.unsharded_numel * 4) * (n - 1) // n
            expected["reduce_scatter"] += (u.grad_layout.unsharded_numel * 4) * (n - 1) // n
        elif isinstance(u, ReplicatedUnit) and u.num_trainable:
            numel = sum(u.params[i].numel() for i in u.trainable)
            expected["all_reduce"] += 2 * (numel * 4) * (n - 1) // n
    measured = {k: stats[k].bytes // steps for k in expected}
    sharded = [u for u in shardwise.units(model) if isinstance(u, ShardedUnit)]
    padded = sum(u.layout.unsharded_numel for u in sharded)
    root = sum(u.layout.unsharded_numel for u in sharded if u.is_root)
    return measured, expected, padded, root


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op", "no_shard"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_per_step_equal_theory(pools, world_size, strategy):
    measured, expected, padded, kept = pools(world_size).run(comm_per_step, strategy)[0]
    assert measured == expected
    n, b = world_size, 4
    psi = sum(p.numel() for p in make("tied").parameters())
    if strategy == "no_shard":  # DDP: 2 psi b (N-1)/N
        assert measured["all_reduce"] == 2 * psi * b * (n - 1) // n
        return
    assert measured["all_reduce"] == 0
    assert padded >= psi  # padding rows (exact bound: test_layout)
    # full shard: 3 psi b (N-1)/N, less the root's backward gather (it stays gathered);
    # shard_grad_op gathers once: 2 psi b (N-1)/N
    theory = (3 * padded - kept if strategy == "full_shard" else 2 * padded) * b * (n - 1) / n
    assert abs(measured["all_gather"] + measured["reduce_scatter"] - theory) <= 8


# --- no_sync over k micro-batches equals one big batch
def accumulate(strategy, k=3):
    ref = make("tied")
    model = shardwise.shard(copy.deepcopy(ref), wrap=wrap_policy("by_class", "tied"), strategy=strategy)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    n = dist.get_world_size()
    x, y = batch("tied", 0, 2 * k * n)
    xs, ys = local_slice(x).chunk(k), local_slice(y).chunk(k)
    shardwise.reset_comm_stats()
    with shardwise.no_sync(model):
        for i in range(k - 1):
            (loss_of(model, xs[i], ys[i]) / k).backward()
    silent = shardwise.comm_stats()
    (loss_of(model, xs[-1], ys[-1]) / k).backward()
    opt.step()
    loss_of(ref, x, y).backward()
    ref_opt.step()
    full = shardwise.full_state_dict(model)
    rs = silent["reduce_scatter"].calls + silent["all_reduce"].calls
    if dist.get_rank():
        return rs, None
    return rs, max((full[k2] - v).abs().max().item() for k2, v in ref.state_dict().items())


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op", "no_shard"])
def test_no_sync_accumulation_equals_big_batch(pools, strategy):
    (silent_reductions, diff), *_ = pools(2).run(accumulate, strategy)
    assert silent_reductions == 0
    assert diff <= 1e-5


# --- a unit's reduce-scatter is finished before the next one is issued: one in flight
def reductions_in_flight(strategy):
    model = shardwise.shard(make("tied"), wrap=wrap_policy("by_class", "tied"), strategy=strategy)
    n = dist.get_world_size()
    x, y = batch("tied", 0, 2 * n)
    pending, most, order = set(), 0, []

    def on(name, unit, **_):
        nonlocal most
        if name == "reduce_issue":
            pending.add(unit)
            order.append(unit)
            most = max(most, len(pending))
        elif name == "reduce_done":
            pending.discard(unit)

    shardwise.core.events.listen(on)
    try:
        loss_of(model, local_slice(x), local_slice(y)).backward()
    finally:
        shardwise.core.events.unlisten(on)
    return most, len(order), pending


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
def test_one_reduction_in_flight(pools, strategy):
    most, issued, left = pools(2).run(reductions_in_flight, strategy)[0]
    assert issued >= 3  # the root and two blocks at least: the bound is a real constraint
    assert most == 1
    assert not left  # the end of backward finishes the rest


# --- a unit frees its full parameters when its backward ends, before its reduction's rows
# are allocated (frozen parameters or not)
def reshard_and_reduce_order(strategy):
    ref = make("mlp")
    ref.layers[2].lin.weight.requires_grad_(False)  # layers.2: a frozen and a trained parameter
    model = shardwise.shard(copy.deepcopy(ref), wrap=wrap_policy("by_class", "mlp"), strategy=strategy)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5)
    x, y = batch("mlp", 0, 2 * dist.get_world_size())
    loss = loss_of(model, local_slice(x), local_slice(y))
    order = _events_of(loss.backward, lambda name, edge: name in ("reshard", "reduce_issue"))
    opt.step()
    loss_of(ref, x, y).backward()
    ref_opt.step()
    return order, _state_diff(model, ref)


def _events_of(backward, keep) -> list[tuple[str, str]]:
    """The (event, unit) pairs ``backward()`` emits that ``keep(name, edge)`` selects."""
    order = []

    def on(name, unit, edge=None, **_):
        if keep(name, edge):
            order.append((name, unit))

    shardwise.core.events.listen(on)
    try:
        backward()
    finally:
        shardwise.core.events.unlisten(on)
    return order


def _state_diff(model, ref) -> float:
    """The largest difference between the sharded model's full state and ``ref``'s (rank 0)."""
    full = shardwise.full_state_dict(model)  # on rank 0
    return max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items()) if full else 0.0


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
def test_unit_reshards_before_its_reduction(pools, strategy):
    order, diff = pools(2).run(reshard_and_reduce_order, strategy)[0]
    first = {}
    for i, (name, unit) in enumerate(order):
        first.setdefault((name, unit), i)
    for unit in ("layers.0", "layers.2", "layers.3"):  # layers.2 has a frozen parameter
        assert first["reshard", unit] < first["reduce_issue", unit], order
    assert ("reduce_issue", "layers.1") not in first  # frozen whole: nothing to reduce
    assert diff <= 1e-6  # one step agrees with the unsharded model


def reduction_events(precision):
    """Each unit's reduce_issue and reduce_done events of one backward (one rank: the local path)."""
    torch.manual_seed(0)
    model = shardwise.shard(make("mlp"), wrap=wrap_policy("by_class", "mlp"), mixed_precision=precision)
    x, y = batch("mlp", 0, 4)
    return _events_of(lambda: loss_of(model, x, y).backward(), lambda name, edge: name in ("reduce_issue", "reduce_done"))


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_every_reduction_done_was_issued_at_one_rank(pools, precision):
    """The trace pairs a unit's reduce_done with its reduce_issue: with a cast at N=1 (no
    collective, a local cast) too; without one there is nothing to reduce and neither comes."""
    events = pools(1).run(reduction_events, precision)[0]
    issued = sorted(u for name, u in events if name == "reduce_issue")
    done = sorted(u for name, u in events if name == "reduce_done")
    assert issued == done and (len(done) > 1 if precision else not done), events



def one_rank_forward(strategy):
    """At N=1 without a cast: whether each Linear computed on the optimizer's own parameters,
    a step's result against the unsharded model's, and the backward ends a listener sees."""
    torch.manual_seed(0)
    ref = make("tied")
    model = shardwise.shard(copy.deepcopy(ref), wrap=wrap_policy("by_class", "tied"), strategy=strategy)
    stepped = {id(p) for p in model.parameters()}
    own = []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda mod, a, o: own.append(all(id(p) in stepped for p in mod.parameters(recurse=False))))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
    for step in range(2):
        x, y = batch("tied", step, 4)
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        loss_of(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    x, y = batch("tied", 2, 4)
    ends = _events_of(lambda: loss_of(model, x, y).backward(), lambda name, edge: name == "backward" and edge == "end")
    return own, _state_diff(model, ref), sorted(u for _, u in ends)


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
def test_one_rank_units_compute_on_the_shard_parameters(pools, strategy):
    """At N=1 without a cast a unit's shard is its whole parameter: the module computes on the
    shard parameters the optimizer steps (no gradient moved), the steps are the unsharded
    model's to the bit, and a listener still sees every unit's backward end."""
    own, diff, ends = pools(1).run(one_rank_forward, strategy)[0]
    assert own and all(own), own
    assert diff == 0.0
    assert ends == ["blocks.0", "blocks.1", "blocks.2"], ends  # (the root's input, tokens, needs no gradient)


# --- gradients kept between steps (zero_grad(set_to_none=False)) accumulate and reduce right
def kept_gradients(strategy, steps=3, k=2):
    ref = make("tied")
    model = shardwise.shard(copy.deepcopy(ref), wrap=wrap_policy("by_class", "tied"), strategy=strategy)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    n = dist.get_world_size()
    storages = []
    for step in range(steps):
        x, y = batch("tied", step, 2 * k * n)
        xs, ys = local_slice(x).chunk(k), local_slice(y).chunk(k)
        with shardwise.no_sync(model):
            (loss_of(model, xs[0], ys[0]) / k).backward()
        (loss_of(model, xs[1], ys[1]) / k).backward()
        storages.append({p.grad.untyped_storage().data_ptr() for p in model.parameters()})
        opt.step()
        opt.zero_grad(set_to_none=False)
        loss_of(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=False)
    full = shardwise.full_state_dict(model)
    diff = max((full[k2] - v).abs().max().item() for k2, v in ref.state_dict().items()) if full else 0.0
    return diff, storages[0] == storages[-1]


@pytest.mark.parametrize("strategy", ["full_shard", "no_shard"])
def test_kept_gradients_accumulate_across_steps(pools, strategy):
    for diff, same_storage in pools(2).run(kept_gradients, strategy):
        assert diff <= 1e-5
        if strategy == "no_shard":  # kept gradients are the bucket's views: reduced in place
            assert same_storage


# --- clip_grad_norm_ gives the unsharded norm
def clip(strategy, norm_type):
    ref = make("tied")
    model = shardwise.shard(copy.deepcopy(ref), wrap=wrap_policy("by_class", "tied"), strategy=strategy)
    n = dist.get_world_size()
    x, y = batch("tied", 0, 2 * n)
    loss_of(model, local_slice(x), local_slice(y)).backward()
    norm = shardwise.clip_grad_norm_(model, 0.05, norm_type)
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    loss_of(ref, x, y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    full = shardwise.full_state_dict(model)
    diff = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items()) if full else 0.0
    return float(norm), float(ref_norm), diff


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("strategy", ["full_shard", "no_shard"])
def test_clip_grad_norm_equals_unsharded(pools, strategy, norm_type):
    for norm, ref_norm, diff in pools(3).run(clip, strategy, norm_type):
        assert norm == pytest.approx(ref_norm, rel=1e-5)
        assert norm > 0.05  # the clip was active
        assert diff <= 1e-6


# --- state dicts
def state_dicts(strategy):
    ref = make("tied")
    model = shardwise.shard(copy.deepcopy(ref), wrap=wrap_policy("by_class", "tied"), strategy=strategy)
    same_keys = list(model.state_dict()) == list(ref.state_dict())
    full = shardwise.full_state_dict(model, rank0_only=False)
    # a round trip through a differently initialised sharded model
    other = shardwise.shard(make("tied", seed=7), wrap=wrap_policy("by_size", "tied"), strategy=strategy)
    shardwise.load_full_state_dict(other, full if dist.get_rank() == 0 else None)
    again = shardwise.full_state_dict(other, rank0_only=False)
    plain = make("tied", seed=9)
    plain.load_state_dict(again)
    exact = all(torch.equal(plain.state_dict()[k], v) for k, v in ref.state_dict().items())
    return same_keys, list(full) == list(ref.state_dict()), exact


@pytest.mark.parametrize("strategy", ["full_shard", "no_shard"])
def test_full_state_dict_round_trip(pools, strategy):
    for same_keys, full_keys, exact in pools(3).run(state_dicts, strategy):
        assert same_keys and full_keys and exact


def bad_state_dict():
    model = shardwise.shard(make("tied"), wrap=wrap_policy("by_class", "tied"))
    sd = shardwise.full_state_dict(model, rank0_only=False)
    sd["blocks.0.fc.weight"] = torch.zeros(3, 3)
    try:
        shardwise.load_full_state_dict(model, sd)
    except shardwise.ShardwiseError as e:
        return str(e)
    return "no error"


def test_load_full_state_dict_names_the_bad_entry_on_every_rank(pools):
    for msg in pools(2).run(bad_state_dict):
        assert "blocks.0.fc.weight" in msg and "(3, 3)" in msg


# --- meta-device init equals eager init with the same seed
def meta_init(size):
    from shardwise.job.models import GPT, gpt_config
    from shardwise.job.models import Block as GPTBlock

    cfg = gpt_config(size)
    torch.manual_seed(3)
    eager = GPT(cfg)
    with torch.device("meta"):
        lazy = GPT(cfg)
    torch.manual_seed(3)
    shardwise.shard(lazy, wrap=shardwise.wrap.by_class(GPTBlock))
    full = shardwise.full_state_dict(lazy)
    if dist.get_rank():
        return True
    return all(torch.equal(full[k], v) for k, v in eager.state_dict().items())


@pytest.mark.parametrize("world_size", [1, 3])
def test_meta_init_equals_eager(pools, world_size):
    assert all(pools(world_size).run(meta_init, "tiny"))


# --- whole parameters outside forward: other methods, inspection, edits
def other_methods():

    ref = make("mlp")
    model = shardwise.shard(copy.deepcopy(ref), wrap=wrap_policy("by_class", "mlp"))
    layer = model.layers[0]
    layer.score = lambda x: (x @ layer.lin.weight.T).sum(-1)  # a method using the weight directly
    shardwise.register_forward_method(layer, "score")
    x = torch.randn(5, 13)
    with torch.no_grad():
        got = layer.score(x)
        want = (x @ ref.layers[0].lin.weight.T).sum(-1)
    assert shardwise.unit_states(model)["layers.0"] == "SHARDED"  # freed again afterwards
    with shardwise.gathered(model, writeback=True):
        shapes_ok = model.layers[0].lin.weight.shape == (17, 13)
        with torch.no_grad():
            model.out.bias.fill_(0.5)
    full = shardwise.full_state_dict(model, rank0_only=False)
    return torch.allclose(got, want, atol=1e-6), shapes_ok, torch.equal(full["out.bias"], torch.full((3,), 0.5))


@pytest.mark.parametrize("world_size", [1, 3])
def test_other_methods_and_gathered(pools, world_size):
    for method_ok, shapes_ok, edit_kept in pools(world_size).run(other_methods):
        assert method_ok and shapes_ok and edit_kept


# --- a sharded model is freed like any other module, also after a tool kept its graph alive
def collected(strategy, tracked):
    import gc
    import weakref

    from torch.distributed._tools.mem_tracker import MemTracker

    model = shardwise.shard(make("tied"), wrap=wrap_policy("by_class", "tied"), strategy=strategy)
    x, y = batch("tied", 0, 2 * dist.get_world_size())
    # MemTracker's module hooks (register_multi_grad_hook, mode "all") hold graph nodes in a
    # cycle through C++ that is never collected: nothing of ours there may lead to the model
    with MemTracker() if tracked else contextlib.nullcontext():
        loss_of(model, local_slice(x), local_slice(y)).backward()
    alive = weakref.ref(model)
    del model
    gc.collect()
    return alive() is None


@pytest.mark.parametrize("tracked", [False, True])
@pytest.mark.parametrize("strategy", ["full_shard", "no_shard"])
def test_sharded_model_is_garbage_collected(pools, strategy, tracked):
    assert all(pools(2).run(collected, strategy, tracked))


# --- a group made with one backend per device ("cpu:gloo", or init_process_group() without a
# backend: "undefined") carries its tensors on Gloo here: shardwise takes Gloo's paths for it
def composite_backend_pair():
    from shardwise.core import groups

    group = dist.new_group(backend="cpu:gloo")
    assert groups.backend(group) == "gloo", groups.backend(group)
    return train_pair("tied", "full_shard", "by_class", steps=3, group=group)


def test_group_with_a_backend_per_device_trains_like_one_process(pool):
    losses, ref_losses, diff, moved = pool.run(composite_backend_pair)[0]
    assert moved > 1e-3  # real training
    assert diff < 1e-5
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5


# --- a unit's backward ends where the hook on its inputs' views fires: with one input or
# several needing gradients, it reduces then, before the unit called before it runs backward
class _Single(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, a, b):
        return self.lin(a) * b


class _PairNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.pair, self.last = _Single(), _Pair(), _Single()

    def forward(self, x):
        h = self.first(x)
        return self.last(self.pair(h, h.sin()))


def end_of_unit_backward(strategy):
    torch.manual_seed(0)
    ref = _PairNet()
    model = shardwise.shard(copy.deepcopy(ref), wrap=shardwise.wrap.by_class(_Single, _Pair), strategy=strategy)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    n, rank = dist.get_world_size(), dist.get_rank()
    x = torch.randn(4 * n, 8, generator=torch.Generator().manual_seed(1))
    loss = model(x[4 * rank : 4 * (rank + 1)]).square().mean()
    order = _events_of(loss.backward, lambda name, edge: name == "reduce_issue" or (name, edge) == ("backward", "begin"))
    opt.step()
    ref(x).square().mean().backward()
    ref_opt.step()
    return order, _state_diff(model, ref)


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
def test_unit_reduces_when_its_backward_ends(pools, strategy):
    order, diff = pools(2).run(end_of_unit_backward, strategy)[0]
    at = {event: i for i, event in reversed(list(enumerate(order)))}  # first occurrences
    # last (one input) reduces before pair's backward; pair (two inputs) before first's
    assert at["reduce_issue", "last"] < at["backward", "pair"], order
    assert at["reduce_issue", "pair"] < at["backward", "first"], order
    assert diff <= 1e-6  # one step agrees with the unsharded model
