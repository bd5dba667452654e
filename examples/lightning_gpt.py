"""Train shardwise's GPT with Lightning's Trainer and ``strategy="shardwise"``.

    python examples/lightning_gpt.py --devices 2                      # Lightning starts the ranks
    torchrun --nproc_per_node 2 examples/lightning_gpt.py --devices 2  # or torchrun does
    python examples/lightning_gpt.py --devices 1 --resume             # go on, at another world size

A plain LightningModule (``training_step``, ``validation_step``, ``configure_optimizers``); the
only shardwise line is ``import shardwise.lightning``, which registers the strategy. Lightning
splits the data over the ranks, accumulates gradients under ``shardwise.no_sync``, clips by
the global norm and writes sharded checkpoints (``--ckpt-dir``: one shardwise checkpoint
directory per Lightning checkpoint); ``--resume`` continues from the last one at any number
of devices. Data: shardwise's offline corpus. Needs ``pip install "shardwise[lightning]"``.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

import shardwise.lightning  # noqa: F401  (registers strategy="shardwise")
from shardwise.job.data import get_batch
from shardwise.job.models import GPT, gpt_config


class Windows(Dataset):
    """Window ``i`` of the corpus's split, as (x, y): a pure function of ``i``."""

    def __init__(self, n: int, seq_len: int, split: str = "train"):
        self.n, self.seq_len, self.split = n, seq_len, split

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x, y = get_batch(i, 1, self.seq_len, split=self.split)
        return x[0], y[0]


class LitGPT(L.LightningModule):
    def __init__(self, size: str = "tiny", lr: float = 3e-3):
        super().__init__()
        self.save_hyperparameters()
        self.gpt = GPT(gpt_config(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gpt(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.gpt(x, y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", self.gpt(x, y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, 16-mixed, bf16-true")
    p.add_argument("--size", default="tiny", help="GPT size: tiny, small, medium, large")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps in all (also when resuming)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank and micro-batch")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--ckpt-dir", default="runs/lightning_gpt")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    L.seed_everything(0, verbose=False)
    model = LitGPT(args.size)
    seq_len = model.gpt.cfg.seq_len
    train = DataLoader(Windows(4096, seq_len), batch_size=args.batch_size)
    val = DataLoader(Windows(64, seq_len, "val"), batch_size=args.batch_size)
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(args.ckpt_dir, save_last=True, every_n_train_steps=10)
    trainer = L.Trainer(
        strategy="shardwise", accelerator=args.accelerator, devices=args.devices,
        precision=args.precision, max_steps=args.steps, accumulate_grad_batches=args.accumulate,
        gradient_clip_val=1.0, val_check_interval=20, limit_val_batches=4,
        callbacks=[checkpoints], logger=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, train, val, ckpt_path="last" if args.resume else None)
    metrics = trainer.validate(model, val, verbose=False)[0]
    if trainer.is_global_zero:
        print(f"{trainer.world_size} ranks, step {trainer.global_step}: val loss "
              f"{metrics['val_loss']:.4f}; checkpoints in {args.ckpt_dir}", flush=True)


if __name__ == "__main__":
    main()
