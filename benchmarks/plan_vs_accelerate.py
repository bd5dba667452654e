"""``shardwise plan`` beside ``accelerate estimate-memory`` on the same configs, and both against
a measured step where the model is small enough to run here.

    pip install accelerate                                   # (not a dependency of shardwise)
    OMP_NUM_THREADS=1 python benchmarks/plan_vs_accelerate.py

``accelerate estimate-memory MODEL`` looks MODEL up on the Hub before it reads the config, so a
local config cannot be given to the command; this script runs what the command computes after
that look-up (accelerate.commands.estimate: the config's ``AutoModel`` built empty,
``calculate_maximum_sizes``, ``estimate_training_usage``; its "Training using Adam" column is
the largest of those figures), on the same config the planner reads. Measured: one process
(world size 1), shardwise's full_shard, fp32, AdamW, torch's MemTracker over the step after
three warm-up steps, ``batch`` sequences of ``seq`` tokens with labels; the plan is for that run.
The 7B and 70B rows (benchmarks/configs) are planned for 64 ranks, NCCL, bf16, 1 x 4096 tokens.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import transformers as tf

import shardwise
from shardwise.planner.cli import _hf
from shardwise.planner.plan import plan

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "tests"))
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, num_hidden_layers=2)


def accelerate_says(config_dir: str) -> dict:
    """What ``accelerate estimate-memory`` prints for the config, fp32 and fp16 rows."""
    from accelerate import init_empty_weights
    from accelerate.commands.estimate import calculate_maximum_sizes, estimate_training_usage

    config = tf.AutoConfig.from_pretrained(config_dir, local_files_only=True)
    with init_empty_weights():
        model = tf.AutoModel.from_config(config)
    total, largest = calculate_maximum_sizes(model)
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "total": total,
        "largest_layer": largest[0],
        "adam_fp32": max(estimate_training_usage(total, "float32").values()),
        "adam_fp16": max(estimate_training_usage(total, "float16").values()),
    }


def measured(build, batch: int, seq: int) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = build()
    shardwise.shard(model, wrap=shardwise.wrap.auto(model))
    opt = torch.optim.AdamW(model.parameters())
    vocab = model.config.vocab_size

    def step():
        ids = torch.randint(0, vocab, (batch, seq))
        outputs = model(input_ids=ids, labels=ids)  # (held to the step's end, as the plan assumes)
        outputs.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    tracker = MemTracker()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tracker.track_external(model, opt)
        with tracker:
            step()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    a = ap.parse_args()
    shardwise.init()
    tiny = {
        "llama": tf.LlamaConfig(**TINY),
        "qwen2": tf.Qwen2Config(**TINY),
        "t5": tf.T5Config(d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2, vocab_size=1024,
                          dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0),
    }
    mib = 2**20
    print("| config | parameters: accelerate (AutoModel) / plan | accelerate: total, Adam fp32 | shardwise plan: model state, peak | measured peak | accelerate / plan error |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in tiny.items():
            config.save_pretrained(f"{tmp}/{name}")
            acc = accelerate_says(f"{tmp}/{name}")
            _, build, _, batch = _hf(f"{tmp}/{name}", a.seq, a.batch)
            with torch.device("meta"):
                wrap = shardwise.wrap.auto(build())
            p = plan(build, world_size=1, strategy="full_shard", wrap=wrap, inputs=batch, backend="gloo")
            e, real = p.estimates[0], measured(build, a.batch, a.seq)
            print(
                f"| {name} (tiny, {a.batch} x {a.seq}) | {acc['parameters']:,} / {p.parameters:,} | "
                f"{acc['total'] / mib:.2f}, {acc['adam_fp32'] / mib:.2f} MiB | {e.model_state / mib:.2f}, "
                f"{e.peak / mib:.2f} MiB | {real / mib:.2f} MiB | {(acc['adam_fp32'] - real) / real:+.0%} / "
                f"{(e.peak - real) / real:+.2%} |",
                flush=True,
            )
    for name in ("llama-2-7b", "llama-2-70b"):
        acc = accelerate_says(str(ROOT / "configs" / name))
        _, build, _, batch = _hf(str(ROOT / "configs" / name), 4096, 1)
        with torch.device("meta"):
            wrap = shardwise.wrap.auto(build())
        e = plan(build, world_size=64, strategy="full_shard", wrap=wrap, mixed_precision="bf16", inputs=batch, backend="nccl")
        print(
            f"| {name} (64 ranks, bf16, 1 x 4096) | {acc['parameters']:,} / {e.parameters:,} | "
            f"{acc['total'] / 2**30:.2f}, {acc['adam_fp32'] / 2**30:.2f} GiB (fp16 row: {acc['adam_fp16'] / 2**30:.2f}) | "
            f"{e.estimates[0].model_state / 2**30:.2f}, {e.estimates[0].peak / 2**30:.2f} GiB | - | - |",
            flush=True,
        )


if __name__ == "__main__":
    main()
