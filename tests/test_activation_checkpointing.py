"""Activation checkpointing: exact parity, fewer activations held."""


import pytest
import torch
import torch.distributed as dist
from nets import Attention, Block, batch, local_slice, loss_of, make, wrap_policy

import shardwise


def train(strategy, checkpoint, steps=4):
    model = shardwise.shard(make("tied"), wrap=wrap_policy("by_class", "tied"), strategy=strategy)
    if checkpoint:
        shardwise.checkpoint_activations(model, shardwise.wrap.by_class(checkpoint))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = batch("tied", step, 2 * dist.get_world_size())
        loss = loss_of(model, local_slice(x), local_slice(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, shardwise.full_state_dict(model)


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op", "no_shard"])
def test_checkpointing_parity(pools, strategy):
    pool = pools(2)
    plain = pool.run(train, strategy, None)[0]
    for target in (Block, Attention):  # the unit itself, and a module inside a unit
        ckpt = pool.run(train, strategy, target)[0]
        for a, b in zip(plain[0], ckpt[0]):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-7)
        for k, v in plain[1].items():
            assert torch.allclose(v, ckpt[1][k], rtol=0, atol=1e-6), k


def activation_peak(checkpoint):
    from torch.distributed._tools.mem_tracker import MemTracker

    from shardwise.job.models import GPT, gpt_config
    from shardwise.job.models import Block as GPTBlock

    torch.manual_seed(0)
    model = shardwise.shard(GPT(gpt_config("tiny", seq_len=64)), wrap=shardwise.wrap.by_class(GPTBlock))
    if checkpoint:
        shardwise.checkpoint_activations(model, shardwise.wrap.by_class(GPTBlock))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 256, (16, 64))
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        model(x, x).backward()
        opt.step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return {str(k): v for k, v in peak.items()}


def test_checkpointing_lowers_peak_activation_memory(pools):
    plain = pools(1).run(activation_peak, False)[0]
    ckpt = pools(1).run(activation_peak, True)[0]
    act = "_MemRefType.ACT"
    assert ckpt[act] * 2 <= plain[act], (plain, ckpt)  # at least 2x fewer activation bytes
    assert ckpt["Total"] < plain["Total"]


def hf_recomputed(selective: bool):
    """A Hugging Face Llama that keeps its KV cache (use_cache=True, as configs ship), sharded at
    N=2 with its decoder layers recomputed, beside the unsharded model without recomputation:
    the largest difference after two SGD steps, how far the reference moved, and the cache
    lengths of the recomputed model's last forward (Note [no KV cache where activations are
    recomputed] in shardwise/core/recompute.py)."""
    import copy
    import warnings

    from hf_nets import build, loss_of, rank_rows, tokens

    ref = build("llama")
    assert ref.config.use_cache
    start = copy.deepcopy(ref.state_dict())
    model = shardwise.shard(copy.deepcopy(ref), wrap=shardwise.wrap.auto(ref))
    shardwise.checkpoint_activations(model, lambda m, name: type(m).__name__ == "LlamaDecoderLayer", selective=selective)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.2) for m in (model, ref))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(2):
            ids = tokens(step, 2 * dist.get_world_size())
            out = model(input_ids=rank_rows(ids), labels=rank_rows(ids))
            out.loss.backward()
            loss_of(ref, ids).backward()
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
    full = shardwise.full_state_dict(model, rank0_only=False)
    diff = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    moved = max((start[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    lengths = [layer.get_seq_length() for layer in out.past_key_values.layers]
    return diff, moved, lengths, any("without its KV cache" in str(w.message) for w in seen)


@pytest.mark.parametrize("selective", [False, True], ids=["full", "selective"])
def test_hf_layers_that_keep_a_kv_cache_recompute(pools, selective):
    for diff, moved, lengths, warned in pools(2).run(hf_recomputed, selective):
        assert moved > 0.01 and diff <= 1e-5, (diff, moved)
        assert lengths == [0, 0] and warned  # no layer's keys twice: none kept while training
