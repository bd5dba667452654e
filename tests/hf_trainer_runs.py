"""What the HF Trainer tests run on every rank of a pool: a tiny Llama trained by transformers'
own ``Trainer`` (DDP across the pool) and by ``shardwise.hf.Trainer`` with the same arguments
(gradient accumulation, clipping, a schedule, checkpoints every 2 steps), resumed from a
checkpoint in a new Trainer, at the same or another world size, and exported."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from pool import framework_task
from torch.utils.data import Dataset

import shardwise

VOCAB, SEQ, SAMPLES = 96, 8, 32


class Tokens(Dataset):
    """Fixed random token rows; labels are the inputs (the model shifts them)."""

    def __init__(self, n: int = SAMPLES, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def llama(seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )
    return tf.LlamaForCausalLM(cfg)


def arguments(out: str, **overrides):
    import transformers as tf

    settings = dict(
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_grad_norm=0.1, learning_rate=1e-2, lr_scheduler_type="linear", max_steps=4,
        save_steps=2, logging_steps=1, report_to="none", use_cpu=True, disable_tqdm=True,
        seed=0, dataloader_num_workers=0,
    )
    return tf.TrainingArguments(**{**settings, **overrides})


def make_trainer(name: str, model, args):
    import transformers as tf

    import shardwise.hf

    cls = shardwise.hf.Trainer if name == "shardwise" else tf.Trainer
    return cls(model=model, args=args, train_dataset=Tokens())


def _state(trainer, name: str) -> dict[str, torch.Tensor]:
    if name == "shardwise":
        return shardwise.full_state_dict(trainer.model, rank0_only=False)
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def train_and_export(tmp: str) -> dict:
    """Both trainers, 4 steps from the same model; shardwise's also exports with save_model."""
    out = {}
    with framework_task():
        for name in ("ddp", "shardwise"):
            t = make_trainer(name, llama(), arguments(f"{tmp}/{name}"))
            t.train()
            out[f"{name}/final"] = _state(t, name)
            out[f"{name}/log"] = [(h["loss"], h["grad_norm"]) for h in t.state.log_history if "loss" in h]
            if name == "shardwise":
                t.save_model(f"{tmp}/export")
                out["accelerator"] = type(t.accelerator).__name__
                out["checkpoint"] = sorted(os.listdir(f"{tmp}/{name}/checkpoint-2"))
        dist.barrier()
        if dist.get_rank() == 0:
            import transformers as tf

            loaded = tf.AutoModelForCausalLM.from_pretrained(f"{tmp}/export")
            out["exported"] = {k: v.detach().clone() for k, v in loaded.state_dict().items()}
    return out


def resume(tmp: str, names=("ddp", "shardwise")) -> dict:
    """Each trainer's checkpoint-2 resumed to step 4 by a new Trainer, in a model of other
    initial values (so nothing but the checkpoint can make it right)."""
    out = {}
    with framework_task():
        for name in names:
            t = make_trainer(name, llama(seed=5), arguments(f"{tmp}/resumed-{name}-{dist.get_world_size()}"))
            t.train(resume_from_checkpoint=f"{tmp}/{name}/checkpoint-2")
            out[f"{name}/resumed"] = _state(t, name)
            out[f"{name}/lr"] = t.lr_scheduler.get_last_lr()[0]
    return out


def refused(tmp: str, kind: str) -> str:
    """What shardwise.hf.Trainer raises for a setting it cannot honour."""
    import shardwise.hf

    overrides = {"fp16": dict(fp16=True), "checkpointing": dict(gradient_checkpointing=True),
                 "parallel": dict(use_cpu=False)}[kind]
    with framework_task():
        try:
            shardwise.hf.Trainer(model=llama(), args=arguments(str(Path(tmp) / kind), **overrides),
                                 train_dataset=Tokens())
        except Exception as e:
            return f"{type(e).__name__}: {e}"
    return "nothing raised"


def best_model(tmp: str) -> tuple[str, float]:
    """load_best_model_at_end with the highest loss as "best": checkpoint-2, not the last one.
    Returns the best checkpoint and how far the trained model ends from its weights."""
    import safetensors.torch

    import shardwise.hf

    args = arguments(f"{tmp}/best", max_steps=6, eval_strategy="steps", eval_steps=2,
                     load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True)
    with framework_task():
        t = shardwise.hf.Trainer(model=llama(), args=args, train_dataset=Tokens(), eval_dataset=Tokens(8, seed=3))
        t.train()
    best = t.state.best_model_checkpoint
    weights = safetensors.torch.load_file(f"{best}/model.safetensors")
    state = shardwise.full_state_dict(t.model, rank0_only=False)
    return Path(best).name, max((state[k] - v).abs().max().item() for k, v in weights.items())
