"""The built-in GPT and MLP stack, and the offline corpus with its batches (single process)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from shardwise.job.data import corpus_text, corpus_tokens, decode, encode, get_batch, rank_slice
from shardwise.job.models import GPT, GPT_SIZES, MLPStack, gpt_config, num_params

NOMINAL = {"tiny": 0.1e6, "small": 10e6, "medium": 30e6, "large": 100e6}


@pytest.mark.parametrize("size", list(NOMINAL))
def test_param_count_near_nominal(size):
    if size == "large":
        with torch.device("meta"):
            model = GPT(gpt_config(size))
    else:
        model = GPT(gpt_config(size))
    assert abs(num_params(model) / NOMINAL[size] - 1) < 0.15, num_params(model)


def test_tied_head_and_no_buffers():
    model = GPT(gpt_config("tiny"))
    assert model.lm_head.weight is model.tok_emb.weight
    untied = sum(p.numel() for n, p in model.named_parameters(remove_duplicate=False))
    assert num_params(model) == untied - model.lm_head.weight.numel()
    assert list(model.buffers()) == []


def test_gpt_config():
    assert gpt_config("small") == GPT_SIZES["small"]
    assert gpt_config("small", seq_len=256).seq_len == 256
    with pytest.raises(ValueError, match="tiny, small, medium, large"):
        gpt_config("huge")


def test_forward_shapes_and_loss():
    cfg = gpt_config("tiny")
    model = GPT(cfg)
    x, y = get_batch(0, 3, cfg.seq_len)
    assert model(x).shape == (3, cfg.seq_len, cfg.vocab_size)
    loss = model(x, y)
    assert loss.ndim == 0
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.2  # N(0, 0.02) init: near uniform


def _reset_in_module_order(model: nn.Module) -> None:
    """Initialise a materialised model as shard() does a meta one: ``reset_parameters()`` of
    each module in ``named_modules()`` order, a parameter already initialised by an earlier
    module swapped for scratch storage while a later owner resets (eager construction
    discards a tied module's own weight in the same way)."""
    done: set[int] = set()
    for _, module in model.named_modules():
        reset = getattr(module, "reset_parameters", None)
        if reset is None:
            continue
        own = {a: p for a, p in module._parameters.items() if p is not None}
        for a, p in own.items():
            if id(p) in done:
                module._parameters[a] = nn.Parameter(torch.empty_like(p))
        try:
            with torch.no_grad():
                reset()
        finally:
            module._parameters.update(own)
        done.update(id(p) for p in own.values())


def test_meta_init_reproduces_eager_build():
    cfg = gpt_config("tiny")
    torch.manual_seed(1234)
    eager = GPT(cfg)
    with torch.device("meta"):
        model = GPT(cfg)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    # to_empty gives each module its own copy of a shared meta parameter: restore the tie
    model.lm_head.weight = model.tok_emb.weight
    torch.manual_seed(1234)
    _reset_in_module_order(model)
    assert model.lm_head.weight is model.tok_emb.weight
    ours, theirs = dict(model.named_parameters()), dict(eager.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in theirs.items():
        assert torch.equal(ours[name], p), name


@pytest.fixture
def one_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy 2-core machine two
    threads made 60 steps take 5-20 s instead of 0.8 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_tiny_gpt_loss_falls(one_thread):
    torch.manual_seed(0)
    cfg = gpt_config("tiny")
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(60):
        x, y = get_batch(step, 16, cfg.seq_len)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # measured: 5.54 -> ~3.2 (mean of the last 5), about the corpus's byte-unigram entropy
    # (3.26 nats); a drop of 1.5 means the model learned at least the byte frequencies
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses


def test_get_batch_is_pure_and_shifted():
    x, y = get_batch(7, 4, 32, seed=3)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, 32)
    torch.manual_seed(999)  # global random state must not matter
    x2, y2 = get_batch(7, 4, 32, seed=3)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, get_batch(8, 4, 32, seed=3)[0])
    assert not torch.equal(x, get_batch(7, 4, 32, seed=4)[0])
    assert torch.equal(x[:, 1:], y[:, :-1])
    # each row is a real window of the corpus, y one token further on
    text = corpus_text()
    for row_x, row_y in zip(x, y):
        start = text.find(decode(row_x) + decode(row_y[-1:]))
        assert start >= 0


def test_val_split_is_the_last_five_percent():
    tokens = corpus_tokens()
    cut = int(len(tokens) * 0.95)
    x, y = get_batch(0, 8, 64, split="val")
    tail = decode(tokens[cut:])
    for row_x, row_y in zip(x, y):
        assert decode(torch.cat([row_x, row_y[-1:]])) in tail
    with pytest.raises(ValueError, match="split"):
        get_batch(0, 1, 8, split="test")


def test_rank_slice_partitions_the_batch():
    x, _ = get_batch(0, 12, 16)
    for world in (1, 2, 3, 4):
        parts = [rank_slice(x, r, world) for r in range(world)]
        assert all(p.shape[0] == 12 // world for p in parts)
        assert torch.equal(torch.cat(parts), x)
    with pytest.raises(ValueError, match="does not split evenly over 5 ranks"):
        rank_slice(x, 0, 5)


def test_corpus():
    text = corpus_text()
    assert 1_000_000 <= len(text) <= 4_000_000
    assert text.isascii()
    tokens = corpus_tokens()
    assert tokens.dtype == torch.uint8 and len(tokens) == len(text)
    assert decode(tokens[:200]) == text[:200]
    assert torch.equal(encode(text[:200]), tokens[:200].long())


def test_mlp_stack_frozen_layers():
    model = MLPStack([8, 16, 16, 4], frozen=(0, 2))
    trains = [[p.requires_grad for p in layer.parameters()] for layer in model.layers]
    assert trains == [[False, False], [True, True], [False, False]]
    assert isinstance(model.layers[-1].act, nn.Identity)
    assert model(torch.randn(5, 8)).shape == (5, 4)
    with pytest.raises(ValueError):
        MLPStack([8, 4], frozen=(1,))
