"""Hybrid sharding on a 2-D mesh (replicate x shard) at world size 4: 2x2, and the degenerate
4x1 (replication only) and 1x4 (sharding only). Sharded within groups of shard_size ranks,
replicated across them: trains like one process, and moves the theory's bytes on each link."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from nets import (
    batch,
    counted_steps,
    global_mean,
    local_slice,
    loss_of,
    make,
    train_pair,
    wrap_policy,
)

import shardwise
from shardwise import ShardwiseError
from shardwise.core.unit import ShardedUnit

HYBRID = ["hybrid_shard", "hybrid_shard_grad_op"]


@pytest.mark.parametrize("kind", ["tied", "mlp"])
@pytest.mark.parametrize("wrap", ["by_class", "by_size"])
@pytest.mark.parametrize("strategy", HYBRID)
def test_parity_2x2(pools, strategy, wrap, kind):
    check_parity(pools(4).run(train_pair, kind, strategy, wrap, steps=6, shard_size=2)[0])


@pytest.mark.parametrize("kind", ["tied", "mlp"])
@pytest.mark.parametrize("shard_size", [1, 4])  # 4x1: replicas only; 1x4: one shard group
def test_parity_degenerate_meshes(pools, shard_size, kind):
    check_parity(pools(4).run(train_pair, kind, "hybrid_shard", "by_class", steps=6, shard_size=shard_size)[0])


def check_parity(result):
    losses, ref_losses, diff, moved = result
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert a == pytest.approx(b, rel=1e-5), f"step {step}: sharded {a} vs reference {b}"
    assert moved > 0.05 and diff <= 1e-5


# --- bytes on each link
def bytes_per_step(strategy, shard_size, steps=2):
    model = shardwise.shard(
        make("tied"), wrap=wrap_policy("by_class", "tied"), strategy=strategy, shard_size=shard_size
    )
    stats = counted_steps(model, steps)
    rt = model._shardwise
    s, r = shard_size, 4 // shard_size
    expected = {"all_gather": 0, "reduce_scatter": 0, "replicate_all_reduce": 0}
    for u in shardwise.units(model):
        gathers = 2 if rt.sharding.reshard_after_forward and not u.is_root else 1
        expected["all_gather"] += gathers * (u.layout.unsharded_numel * 4) * (s - 1) // s
        expected["reduce_scatter"] += (u.grad_layout.unsharded_numel * 4) * (s - 1) // s
        expected["replicate_all_reduce"] += 2 * (u.grad_layout.sizes[u.rank] * 4) * (r - 1) // r
    measured = {k: stats[k].bytes // steps for k in expected}
    padded = sum(u.grad_layout.unsharded_numel for u in shardwise.units(model))
    calls = stats["replicate_all_reduce"].calls // steps
    bucketed = sum(len(b.units) for b in rt.buckets)
    units = len(shardwise.units(model)) - bucketed + len(rt.buckets)  # a bucket all-reduces once
    return measured, expected, padded, (calls, units, len(rt.buckets)), stats["all_reduce"].bytes


@pytest.mark.parametrize("strategy", HYBRID)
@pytest.mark.parametrize("shard_size", [1, 2, 4])
def test_bytes_on_each_link_equal_theory(pools, strategy, shard_size):
    measured, expected, padded, calls, all_reduce = pools(4).run(bytes_per_step, strategy, shard_size)[0]
    assert measured == expected
    s, r, b = shard_size, 4 // shard_size, 4
    # across shard groups: 2 psi b (R-1)/(R S), psi counted with its padding rows
    assert measured["replicate_all_reduce"] == pytest.approx(2 * padded * b * (r - 1) / (r * s), abs=8)
    calls, units, buckets = calls
    # one all-reduce per unit (3 blocks and the root), a bucket of units (the 3 blocks) once
    assert buckets == (1 if s > 1 else 0)
    assert calls == (units if r > 1 else 0) and units == 4 - 2 * buckets
    assert all_reduce == 0


# --- no_sync, clipping, mixed precision, offload, activation checkpointing at 2x2
def hybrid_against_full_shard(options: dict, micro: int = 1, clip: float | None = None, steps: int = 3):
    """The same training under hybrid_shard at 2x2 and under full_shard (already checked against
    one process); returns both runs' losses, final parameters and clipped norms on rank 0."""
    runs = []
    for strategy, extra in (("hybrid_shard", {"shard_size": 2}), ("full_shard", {})):
        torch.manual_seed(0)
        model = shardwise.shard(make("tied"), wrap=wrap_policy("by_class", "tied"), strategy=strategy, **extra, **options.get("shard", {}))
        if options.get("checkpoint"):
            shardwise.checkpoint_activations(model, shardwise.wrap.by_class(type(model.blocks[0])))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, norms = [], []
        shardwise.reset_comm_stats()
        for step in range(steps):
            x, y = batch("tied", step, 8 * micro)
            for i, (xi, yi) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
                sync = contextlib.nullcontext() if i == micro - 1 else shardwise.no_sync(model)
                with sync:
                    loss = loss_of(model, local_slice(xi), local_slice(yi)) / micro
                    loss.backward()
            if clip is not None:
                norms.append(shardwise.clip_grad_norm_(model, clip).item())
            opt.step()
            opt.zero_grad()
            losses.append(global_mean(loss))
        stats = shardwise.comm_stats()
        runs.append((losses, shardwise.full_state_dict(model), norms, stats["replicate_all_reduce"].calls))
    return runs if dist.get_rank() == 0 else None


@pytest.mark.parametrize(
    "name, options, micro, clip, rel",
    [
        ("no_sync", {}, 3, None, 1e-5),
        ("clip", {}, 1, 0.1, 1e-5),
        ("bf16", {"shard": {"mixed_precision": "bf16"}}, 1, None, 1e-5),
        ("offload", {"shard": {"cpu_offload": True}}, 1, None, 1e-6),
        ("checkpointing", {"checkpoint": True}, 1, None, 1e-6),
    ],
)
def test_hybrid_with_every_feature_equals_full_shard(pools, name, options, micro, clip, rel):
    (h_losses, h_sd, h_norms, h_calls), (f_losses, f_sd, f_norms, _) = pools(4).run(
        hybrid_against_full_shard, options, micro, clip
    )[0]
    assert h_losses == pytest.approx(f_losses, rel=rel)
    assert h_norms == pytest.approx(f_norms, rel=1e-5)
    if clip is not None:
        assert all(n > clip for n in h_norms)  # it really clipped
    atol = 2e-2 if name == "bf16" else 1e-5
    assert all(torch.allclose(h_sd[k], f_sd[k], rtol=0, atol=atol) for k in f_sd)
    # one all-reduce per unit and step, none in no_sync micro-batches; from the second backward on
    # (the first gives the order: buckets.py) the 3 blocks share one bucket's
    assert h_calls == (3 * 2 if micro > 1 else 4 + 2 * 2)


# --- a DeviceMesh, as torchtitan and FSDP2 users describe the layout
def with_device_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    results = []
    for how in ("mesh", "shard_size"):
        torch.manual_seed(0)
        options = (
            {"mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))}
            if how == "mesh"
            else {"shard_size": 2}
        )
        model = shardwise.shard(make("tied"), wrap=wrap_policy("by_class", "tied"), strategy="hybrid_shard", **options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            x, y = batch("tied", step, 8)
            loss_of(model, local_slice(x), local_slice(y)).backward()
            opt.step()
            opt.zero_grad()
        results.append(shardwise.full_state_dict(model))
    if dist.get_rank():
        return True
    return all(torch.equal(results[0][k], results[1][k]) for k in results[0])


def test_a_device_mesh_equals_shard_size(pools):
    assert pools(4).run(with_device_mesh)[0]


def bad_layouts():
    from torch.distributed.device_mesh import init_device_mesh

    def refused(**kwargs):
        try:
            shardwise.shard(make("mlp"), **kwargs)
        except ShardwiseError as e:
            return str(e)
        return "accepted"

    return {
        "not dividing": refused(strategy="hybrid_shard", shard_size=3),
        "shard_size without hybrid": refused(strategy="full_shard", shard_size=2),
        "1-D mesh for hybrid": refused(strategy="hybrid_shard", mesh=init_device_mesh("cpu", (4,))),
        "2-D mesh without hybrid": refused(strategy="full_shard", mesh=init_device_mesh("cpu", (2, 2))),
    }


def test_bad_layouts_are_named_with_the_fix(pools):
    msgs = pools(4).run(bad_layouts)[0]
    assert "must divide the world size 4" in msgs["not dividing"]
    assert "use strategy='hybrid_shard'" in msgs["shard_size without hybrid"]
    assert "takes a 2-D mesh of shape (replicate, shard)" in msgs["1-D mesh for hybrid"]
    assert "is for hybrid sharding" in msgs["2-D mesh without hybrid"]


def layout_of_hybrid():
    model = shardwise.shard(make("tied"), wrap=wrap_policy("by_class", "tied"), strategy="hybrid_shard", shard_size=2)
    u = next(u for u in shardwise.units(model) if isinstance(u, ShardedUnit))
    return dist.get_rank(), u.rank, u.world, u.replicate_size, [p.shape for p in u.shard_params]


def test_each_rank_holds_one_half_replicated_across_groups(pools):
    rows = pools(4).run(layout_of_hybrid)
    assert [(g, s, n, r) for g, s, n, r, _ in rows] == [(0, 0, 2, 2), (1, 1, 2, 2), (2, 0, 2, 2), (3, 1, 2, 2)]
    assert rows[0][4] == rows[2][4]  # the same shards on the same position of each group
