"""``shardwise convert CKPT OUT [--to hf|dcp]``: a checkpoint to a standard safetensors model
or to a torch.distributed.checkpoint directory, offline."""

from __future__ import annotations

import argparse

from .conversion import convert


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="shardwise convert",
        description="Write a checkpoint's parameters and buffers as a standard safetensors "
        "model: model.safetensors, or model-0000i-of-0000N.safetensors files and their index; "
        "or (--to dcp) the whole checkpoint as a torch.distributed.checkpoint directory.",
    )
    p.add_argument("ckpt", help="checkpoint directory written by shardwise.save()")
    p.add_argument("out", help="output directory")
    p.add_argument(
        "--max-shard-bytes",
        type=int,
        default=5 * 2**30,
        help="largest output file, in bytes (default 5 GiB)",
    )
    p.add_argument(
        "--to",
        choices=("hf", "dcp"),
        default="hf",
        help="hf: a Hugging Face style safetensors model (default); dcp: model, optimizer, "
        "step and extra as torch.distributed.checkpoint files, which FSDP2 loads",
    )
    a = p.parse_args(argv)
    for path in convert(a.ckpt, a.out, max_shard_bytes=a.max_shard_bytes, to=a.to):
        print(path)
