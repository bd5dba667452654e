"""A rank that dies or takes another path ends every rank with an error naming the unit,
within the group's timeout, never a hang."""

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
from nets import batch, local_slice, loss_of, make, wrap_policy
from pool import WorkerPool

import shardwise

GROUP_TIMEOUT = 6.0


@pytest.fixture
def fragile_pool():
    """A pool of its own (these tests break it) with a short collective timeout."""
    pool = WorkerPool(2, timeout=60, group_timeout=GROUP_TIMEOUT)
    yield pool
    pool.close()


def die_or_diverge(how: str, strategy: str = "full_shard"):
    model = shardwise.shard(make("tied"), wrap=wrap_policy("by_class", "tied"), strategy=strategy)
    if dist.get_rank() == 1:
        if how == "die":
            model.blocks[1].register_forward_pre_hook(lambda m, a: os._exit(7))
        else:  # a branch taken by the data: this rank never calls blocks.1
            model.blocks = torch.nn.ModuleList(b for i, b in enumerate(model.blocks) if i != 1)
    for step in range(3):
        x, y = batch("tied", step, 4)
        loss_of(model, local_slice(x), local_slice(y)).backward()
    shardwise.full_state_dict(model)
    return "finished"


def switch_on_sharded_units(strategy: str):
    from test_unused import train_switch

    return train_switch(strategy)


def test_dead_rank_ends_the_others_with_a_named_unit(fragile_pool):
    t0 = time.monotonic()
    out = fragile_pool.run_outcomes(die_or_diverge, "die")
    assert time.monotonic() - t0 < GROUP_TIMEOUT + 20
    assert out[1].exitcode == 7
    assert not out[0].ok and out[0].error_type.endswith("CollectiveError"), out[0]
    message = out[0].error_message
    assert "for unit 'blocks." in message and "rank 0" in message
    assert "rank 1: no answer" in message


WHERE = r"rank (\d): call #(\d+) (\w+) for unit '([^']+)'"


def assert_named_on_every_rank(out, units):
    for o in out:
        assert not o.ok, f"rank {o.rank} finished although its peer took another path"
        assert o.error_type.endswith("CollectiveError"), o
        assert "wrap the parent module" in o.error_message
        where = re.findall(WHERE, o.error_message)
        assert [r for r, *_ in where] == ["0", "1"], o.error_message
        assert where[0][1] == where[1][1]  # the same call, on a different unit
        assert [w[3] for w in where] == units, o.error_message


def test_a_rank_that_skips_a_unit_is_named_on_every_rank(fragile_pool):
    t0 = time.monotonic()
    out = fragile_pool.run_outcomes(die_or_diverge, "diverge")
    assert time.monotonic() - t0 < GROUP_TIMEOUT + 15
    assert_named_on_every_rank(out, ["blocks.1", "blocks.2"])


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
def test_experts_as_units_on_different_ranks_are_named_on_every_rank(fragile_pool, strategy):
    t0 = time.monotonic()
    out = fragile_pool.run_outcomes(switch_on_sharded_units, strategy)
    assert time.monotonic() - t0 < GROUP_TIMEOUT + 15
    assert_named_on_every_rank(out, ["experts.0", "experts.1"])


INIT_TIMEOUT_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch, shardwise
    shardwise.init(timeout=3)
    model = shardwise.shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)),
                            wrap=lambda m, name: name == "1")
    if torch.distributed.get_rank() == 1:
        time.sleep(30)  # a stalled rank
        sys.exit(0)
    t0 = time.monotonic()
    try:
        model(torch.randn(2, 4))
    except shardwise.CollectiveError as e:
        print("ELAPSED", time.monotonic() - t0, "MESSAGE", e)
    """
)


def test_init_timeout_bounds_a_stalled_collective(tmp_path):
    script = tmp_path / "stall.py"
    script.write_text(INIT_TIMEOUT_SCRIPT)
    port = 29000 + os.getpid() % 2000
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True))
    out0, _ = procs[0].communicate(timeout=60)
    procs[1].kill()
    assert "ELAPSED" in out0, out0
    elapsed = float(out0.split("ELAPSED")[1].split()[0])
    assert 2.5 <= elapsed <= 10, elapsed
    assert "for unit '<root>'" in out0 or "for unit '1'" in out0


# --- hybrid sharding: a dead peer across the replicas
def die_in_replica_all_reduce():
    """2x2 (replicas x shard): rank 2 dies as it would issue its first all-reduce across the
    replicas, leaving rank 0, its peer there, waiting in that all-reduce; rank 3 loses its
    shard group's peer, and rank 1 then its peer across the replicas."""
    from shardwise.core import collectives

    model = shardwise.shard(
        make("tied"), wrap=wrap_policy("by_class", "tied"), strategy="hybrid_shard", shard_size=2
    )
    if dist.get_rank() == 2:
        all_reduce = collectives.all_reduce

        def die_first(*args, **kwargs):
            if kwargs.get("kind") == "replicate_all_reduce":
                os._exit(7)
            return all_reduce(*args, **kwargs)

        collectives.all_reduce = die_first
    for step in range(3):
        x, y = batch("tied", step, 8)
        loss_of(model, local_slice(x), local_slice(y)).backward()
    return "finished"


def test_dead_peer_ends_every_hybrid_survivor_within_the_timeout():
    pool = WorkerPool(4, timeout=60, group_timeout=GROUP_TIMEOUT)
    try:
        t0 = time.monotonic()
        out = pool.run_outcomes(die_in_replica_all_reduce)
        elapsed = time.monotonic() - t0
    finally:
        pool.close()
    assert out[2].exitcode == 7
    for o in (out[0], out[1], out[3]):
        assert not o.ok and o.error_type.endswith("CollectiveError"), o
        assert "rank 2: no answer" in o.error_message, o.error_message
    assert "replicate_all_reduce for unit 'blocks." in out[0].error_message, out[0].error_message
    # (the shard and replicate groups take the default group's timeout, not torch's 30 minutes)
    assert elapsed < GROUP_TIMEOUT + 20, elapsed
