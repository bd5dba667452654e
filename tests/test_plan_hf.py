"""The planner on Hugging Face models it was never shaped on (Llama, Qwen2, a Mixtral-like
mixture of experts, T5), against torch's MemTracker over a steady-state step of a real run at
N=2, with the loss inside the model (labels) and outside it, the output held by the loop or
dropped; and ``shardwise plan --hf`` / ``--model`` from the command line.

Tiny random configs built here (nothing is downloaded), a vocabulary large against the width so
that the logits weigh on the peak as they do on real models.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers as tf

import shardwise
from shardwise.observer.accounting import kept_buckets
from shardwise.planner import cli
from shardwise.planner import plan as P

WIDTH = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
VOCAB, BATCH, SEQ, WORLD, WARMUP = 1024, 2, 64, 2, 3


def llama():
    return tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=2, vocab_size=VOCAB, **WIDTH))


def qwen2():
    return tf.Qwen2ForCausalLM(tf.Qwen2Config(num_hidden_layers=2, vocab_size=VOCAB, **WIDTH))


def mixtral():  # grouped_mm experts: torch's fake kernel takes bf16 only (planned in bf16)
    config = tf.MixtralConfig(
        num_hidden_layers=2, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2, **WIDTH
    )
    return tf.MixtralForCausalLM(config)


def t5():
    config = tf.T5Config(
        d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2, vocab_size=VOCAB,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )
    return tf.T5ForConditionalGeneration(config)


MODELS = {"llama": llama, "qwen2": qwen2, "mixtral": mixtral, "t5": t5}


def batch() -> dict:
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


def logits_of(model, ids):
    decoder = {"decoder_input_ids": ids} if model.config.is_encoder_decoder else {}
    return model(input_ids=ids, **decoder).logits


def outside(model, input_ids, labels):
    """The loss computed outside the model, from its logits."""
    return F.cross_entropy(logits_of(model, input_ids).flatten(0, 1).float(), labels.flatten())


@dataclass(frozen=True)
class Case:
    """``loop``: "labels" (``out = model(input_ids=, labels=)``, then ``out.loss.backward()``:
    the loss inside, the output held), "held" (``out = model(input_ids=)``, the loss outside
    from ``out.logits``, the output held to the step's end) or "dropped" (a loss function's
    frame drops the output before backward)."""

    model: str
    loop: str = "labels"
    precision: str | None = None


CASES = [
    Case("llama"),
    Case("llama", "dropped"),
    Case("qwen2", "held"),
    Case("mixtral", precision="bf16"),
    Case("t5"),
    Case("t5", "held"),
]


def measure(cases: list[Case]):
    """Per case: MemTracker's peak over a step after WARMUP steps, the model state a step
    leaves, and the parameters."""
    return [measure_one(c) for c in cases]


def measure_one(case: Case):
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = MODELS[case.model]()
    n_params = sum(p.numel() for p in model.parameters())
    shardwise.shard(model, wrap=shardwise.wrap.auto(model), mixed_precision=case.precision)
    opt = torch.optim.AdamW(model.parameters())
    g = torch.Generator().manual_seed(dist.get_rank())
    held = {}

    def step():
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        if case.loop == "labels":
            out = model(input_ids=ids, labels=ids)
            loss = out.loss
        elif case.loop == "held":  # (the whole output: its cache and encoder states too)
            decoder = {"decoder_input_ids": ids} if model.config.is_encoder_decoder else {}
            out = model(input_ids=ids, **decoder)
            loss = F.cross_entropy(out.logits.flatten(0, 1).float(), ids.flatten())
        else:
            loss = outside(model, ids, ids)
        loss.backward()
        held.update(shardwise.held_bytes(model))
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(WARMUP):
        step()
    tracker = MemTracker()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tracker.track_external(model, opt, *kept_buckets(model))
        with tracker:
            step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    state = sum(v.nbytes for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    return peak, held["params"] + held["grads"] + state, n_params


def predict(case: Case) -> P.Plan:
    build = MODELS[case.model]
    with torch.device("meta"):
        wrap = shardwise.wrap.auto(build())
    return P.plan(
        build, world_size=WORLD, strategy="full_shard", wrap=wrap, mixed_precision=case.precision,
        inputs=batch, loss=None if case.loop == "labels" else outside,
        holds_output=case.loop != "dropped", backend="gloo",
    )


def test_hf_models_within_two_percent_of_memtracker(pools):
    measured = pools(WORLD).run(measure, CASES)[0]
    errors = []
    for case, (peak, state, n_params) in zip(CASES, measured):
        p = predict(case)
        e = p.estimates[0]
        errors.append((case, e.peak, peak, (e.peak - peak) / peak))
        assert p.parameters == n_params, case  # exact, each tied parameter once
        assert e.model_state == state, (case, e.model_state, state)
    print(
        f"\nplanner against MemTracker, N={WORLD}, {WARMUP} warm-up steps:",
        *(f"\n  {c}: planned {a / 2**20:.3f} MiB, measured {b / 2**20:.3f} MiB ({r:+.2%})" for c, a, b, r in errors),
    )
    assert all(abs(r) <= 0.02 for *_, r in errors), errors


def test_a_step_that_fails_on_fake_tensors_says_why():
    with pytest.raises(shardwise.ShardwiseError, match="bf16 only"):
        predict(Case("mixtral"))  # fp32: grouped_mm's fake kernel refuses it


# --- the command line
def test_plan_command_on_an_hf_config(tmp_path, capsys):
    llama().config.save_pretrained(tmp_path / "llama")
    argv = ["--hf", str(tmp_path / "llama"), "--world-size", "4", "--backend", "nccl",
            "--mixed-precision", "bf16", "--seq-len", str(SEQ), "--strategy", "full_shard"]
    cli.main([*argv, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["format"] == "shardwise-plan" and out["parameters"] == sum(p.numel() for p in llama().parameters())
    e = out["estimates"][0]
    def one_sequence():  # as the command makes it
        ids = torch.zeros(1, SEQ, dtype=torch.long)
        return {"input_ids": ids, "labels": ids}

    api = P.plan(
        llama, world_size=4, strategy="full_shard", wrap=shardwise.wrap.auto(llama()),
        mixed_precision="bf16", inputs=one_sequence, backend="nccl",
    ).estimates[0]
    assert (e["peak_bytes"], e["model_state_bytes"], e["sent_bytes"]) == (api.peak, api.model_state, api.comm)
    assert [u["name"] for u in e["units"]] == ["model.layers.0", "model.layers.1", "<root>"]
    assert out["budget"] is None
    cli.main([*argv[:-2], "--wrap", "none", "--budget", "1GiB", "--json"])  # (one unit: a short search)
    chosen = json.loads(capsys.readouterr().out)["budget"]
    assert chosen["chosen"] is not None and chosen["settings"]["units"][-1]["name"] == ""
    cli.main(argv)
    text = capsys.readouterr().out
    assert "LlamaForCausalLM" in text and "1 x 64 token ids with labels" in text and "4 ranks (nccl)" in text
    with pytest.raises(SystemExit, match="nothing is"):
        cli.main(["--hf", str(tmp_path / "missing")])


MODULE = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


def build():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def batch():
    return torch.zeros(16, 32), torch.zeros(16, dtype=torch.long)


def loss(model, x, y):
    return F.cross_entropy(model(x), y)
'''


def test_plan_command_on_a_model_of_ones_own(tmp_path, monkeypatch, capsys):
    (tmp_path / "mynets.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)  # importable as python -m finds it
    monkeypatch.syspath_prepend(str(tmp_path))
    cli.main(["--model", "mynets:build", "--inputs", "mynets:batch", "--loss", "mynets:loss", "--wrap", "none", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["parameters"] == 32 * 64 + 64 + 64 * 8 + 8
    assert [e["strategy"] for e in out["estimates"]] == ["full_shard", "shard_grad_op", "no_shard"]
    with pytest.raises(SystemExit, match=r"pkg\.module:function"):
        cli.main(["--model", "mynets.build"])
    with pytest.raises(SystemExit, match="nonesuch"):
        cli.main(["--model", "mynets:nonesuch"])
