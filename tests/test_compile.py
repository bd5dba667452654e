"""torch.compile on sharded models: per-block and whole-model, parity with eager, one graph
per block, no recompilation.

The compiled runs happen in a pool of their own: before shardwise kept its hooks out of
dynamo, inductor killed both ranks with SIGSEGV, and a crash here must fail these tests (as
a dead worker, exit code -11) without taking the shared pools down with it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from nets import Attention, Block, batch, local_slice, loss_of, make, wrap_policy
from pool import WorkerPool

import shardwise

# (strategy, mixed precision, activation checkpointing, what is compiled)
CASES = [
    ("full_shard", None, None, "blocks"),
    ("shard_grad_op", None, None, "blocks"),
    ("no_shard", None, None, "blocks"),
    ("full_shard", None, "block", "blocks"),
    ("full_shard", None, "attention", "blocks"),
    ("full_shard", None, None, "model"),
    ("full_shard", "bf16", None, "blocks"),
    ("no_shard", "bf16", None, "blocks"),
]


def _sharded(ref, strategy, mp, ckpt):
    model = shardwise.shard(
        copy.deepcopy(ref), wrap=wrap_policy("by_class", "tied"), strategy=strategy, mixed_precision=mp
    )
    if ckpt is not None:
        shardwise.checkpoint_activations(model, shardwise.wrap.by_class(Block if ckpt == "block" else Attention))
    return model


def _step(model, opt, step):
    """One optimizer step over two micro-batches (the first under no_sync), clipped."""
    n = dist.get_world_size()
    losses = []
    for micro in range(2):
        x, y = batch("tied", 10 * step + micro, 2 * n)
        sync = shardwise.no_sync(model) if micro == 0 else _nothing()
        with sync:
            loss = loss_of(model, local_slice(x), local_slice(y))
            loss.backward()
        losses.append(loss.item())
    shardwise.clip_grad_norm_(model, 0.5)
    opt.step()
    opt.zero_grad()
    return losses


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def compiled_vs_eager(cases, backend="inductor", steps=3):
    """Train each case compiled and eager side by side; per case, return the largest loss
    and parameter differences, how far training moved the parameters, the graph breaks and
    the graphs compiled after the first step."""
    from torch._dynamo.utils import counters

    out = []
    for strategy, mp, ckpt, what in cases:
        torch._dynamo.reset()
        counters.clear()
        ref = make("tied")
        start = {k: v.clone() for k, v in ref.state_dict().items()}
        eager = _sharded(ref, strategy, mp, ckpt)
        model = _sharded(ref, strategy, mp, ckpt)
        if what == "blocks":
            for m in model.modules():
                if isinstance(m, Block):
                    m.compile(backend=backend)
            run = model
        else:
            run = torch.compile(model, backend=backend)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
        loss_diff, graphs_after_first = 0.0, None
        for step in range(steps):
            got = _step(run, opt, step)
            want = _step(eager, eager_opt, step)
            loss_diff = max(loss_diff, *(abs(a - b) / abs(b) for a, b in zip(got, want)))
            if step == 0:
                graphs_after_first = counters["stats"]["unique_graphs"]
        full, eager_full = shardwise.full_state_dict(model), shardwise.full_state_dict(eager)
        new_graphs = counters["stats"]["unique_graphs"] - graphs_after_first
        breaks = sum(counters["graph_break"].values())
        if dist.get_rank() == 0:
            diff = max((full[k] - v).abs().max().item() for k, v in eager_full.items())
            moved = max((start[k] - v).abs().max().item() for k, v in eager_full.items())
            out.append({"loss_diff": loss_diff, "diff": diff, "moved": moved, "new_graphs": new_graphs,
                        "breaks": breaks, "graphs": counters["stats"]["unique_graphs"]})
    return out


@pytest.fixture(scope="module")
def compile_pool():
    with WorkerPool(2, timeout=600) as pool:
        yield pool


def test_compiled_blocks_and_model_match_eager(compile_pool):
    results = compile_pool.run(compiled_vs_eager, CASES)[0]
    for case, r in zip(CASES, results):
        _, mp, _, what = case
        assert r["graphs"] >= 1, case  # something was compiled
        assert r["new_graphs"] == 0, (case, r)  # no recompilation after the first step
        assert r["moved"] > 0.02, (case, r)  # real training
        if what == "blocks":
            assert r["breaks"] == 0, (case, r)  # one graph per block: no break inside it
        if mp is None:
            assert r["loss_diff"] < 1e-5 and r["diff"] < 1e-5, (case, r)
        else:  # inductor keeps bf16 intermediates in fp32 where eager rounds each op
            assert r["loss_diff"] < 2e-2, (case, r)


def compile_refusals():
    """What a combination that cannot work raises: the whole model with fullgraph=True (the
    hooks must break the graph), and compiled autograd (it would trace the hooks)."""
    model = shardwise.shard(make("tied"), wrap=wrap_policy("by_class", "tied"))
    x, y = batch("tied", 0, 2 * dist.get_world_size())
    x, y = local_slice(x), local_slice(y)
    raised = []
    try:
        loss_of(torch.compile(model, backend="eager", fullgraph=True), x, y)
    except torch._dynamo.exc.Unsupported as exc:
        raised.append(str(exc))
    torch._dynamo.config.compiled_autograd = True
    try:
        loss_of(model, x, y).backward()
    except shardwise.ShardwiseError as exc:
        raised.append(str(exc))
    finally:
        torch._dynamo.config.compiled_autograd = False
    loss_of(model, x, y).backward()  # and the model still trains
    return raised


def test_impossible_combinations_say_what_to_do(compile_pool):
    fullgraph, compiled_autograd = compile_pool.run(compile_refusals)[0]
    assert "block.compile()" in fullgraph and "fullgraph=True" in fullgraph
    assert "compiled autograd" in compiled_autograd and "off" in compiled_autograd


def test_compiled_blocks_with_owned_matrices_and_muon(compile_pool):
    # owned placement gathers ragged shards around the compiled forward: Muon stays exact
    from test_placement import check, train_whole

    check(compile_pool.run(train_whole, "tied", compile_blocks=True, steps=4)[0])
