"""Train a Hugging Face causal LM with transformers' Trainer, sharded by shardwise.

    torchrun --nproc_per_node 2 examples/hf_trainer.py --out runs/hf_trainer
    torchrun --nproc_per_node 1 examples/hf_trainer.py --out runs/hf_trainer --resume --steps 60

A usual Trainer script (TrainingArguments, a dataset, ``trainer.train()``, ``trainer.evaluate()``,
``trainer.save_model()``) with ``shardwise.hf.Trainer`` in place of ``transformers.Trainer``: the
model is sharded when the Trainer is built (units by ``wrap.auto``: one per
``LlamaDecoderLayer``), gradients are accumulated under ``shardwise.no_sync`` and clipped by
their global norm, every checkpoint holds the sharded model and optimizer (``checkpoint-N/
shardwise``, which ``--resume`` loads at any number of processes) beside a ``from_pretrained``
directory, and ``save_model`` writes ``--out``/final, which rank 0 reloads with
``AutoModelForCausalLM.from_pretrained`` to check that it gives the sharded model's loss.
The model is a Llama from a config over bytes (random weights: nothing is downloaded), trained
on shardwise's offline corpus. Needs ``pip install "shardwise[hf]"``.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, TrainingArguments

import shardwise
import shardwise.hf
from shardwise.job.data import get_batch


class Windows(Dataset):
    """Window ``i`` of the corpus's split, as input ids (the model shifts its labels itself)."""

    def __init__(self, n: int, seq_len: int, split: str = "train"):
        self.n, self.seq_len, self.split = n, seq_len, split

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, _ = get_batch(i, 1, self.seq_len, split=self.split)
        return {"input_ids": x[0], "labels": x[0]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output directory: checkpoints, and final/")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps in all (also when resuming)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per process and micro-batch")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--bf16", action="store_true", help="shardwise's bf16 mixed precision")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len,
        bos_token_id=None, eos_token_id=None,
    )
    model = LlamaForCausalLM(config)
    training = TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, gradient_accumulation_steps=args.accumulate,
        learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=5, max_grad_norm=1.0,
        save_steps=args.save_steps, logging_steps=10, bf16=args.bf16, report_to="none",
        use_cpu=not torch.cuda.is_available(), disable_tqdm=True, seed=0,
    )
    trainer = shardwise.hf.Trainer(
        model=model, args=training,
        train_dataset=Windows(4096, args.seq_len), eval_dataset=Windows(64, args.seq_len, "val"),
    )
    trainer.train(resume_from_checkpoint=args.resume or None)
    metrics = trainer.evaluate()
    final = f"{args.out}/final"
    trainer.save_model(final)

    x = Windows(2, args.seq_len, "val")[0]["input_ids"][None]
    device = shardwise.core.groups.device()
    with torch.no_grad():  # every rank the same batch: the sharded model's loss on it
        sharded = trainer.model(input_ids=x.to(device), labels=x.to(device)).loss.item()
    if dist.get_rank() == 0:
        dtype = torch.bfloat16 if args.bf16 else torch.float32  # bf16: as the sharded model computes
        reloaded = AutoModelForCausalLM.from_pretrained(final, dtype=dtype).to(device)
        with torch.no_grad():
            again = reloaded(input_ids=x.to(device), labels=x.to(device)).loss.item()
        print(f"{dist.get_world_size()} processes, step {trainer.state.global_step}: eval loss "
              f"{metrics['eval_loss']:.4f}; {final} reloaded with from_pretrained: loss {again:.6f} "
              f"(sharded {sharded:.6f})", flush=True)
        if not math.isclose(again, sharded, rel_tol=1e-2 if args.bf16 else 1e-5):
            raise SystemExit("the reloaded model does not give the sharded model's loss")
    dist.barrier()


if __name__ == "__main__":
    main()
