"""``shardwise convert CKPT OUT [--to hf|dcp|shardwise]``: a checkpoint to a standard
safetensors model or to a torch.distributed.checkpoint directory, or such a directory to
shardwise's own format, offline.

    shardwise convert ckpt/step-00000100 hf-model
    shardwise convert ckpt/step-00000100 dcp-100 --to dcp
    shardwise convert outputs/checkpoint/step-1000 ckpt/step-1000 --to shardwise \
        --model mypkg.models:build --optimizer AdamW
"""

from __future__ import annotations

import argparse

import torch.nn as nn

from ..core.errors import ShardwiseError
from .conversion import convert


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="shardwise convert",
        description="Write a checkpoint's parameters and buffers as a standard safetensors "
        "model: model.safetensors, or model-0000i-of-0000N.safetensors files and their index; "
        "or (--to dcp) the whole checkpoint as a torch.distributed.checkpoint directory; or "
        "(--to shardwise) such a directory, as FSDP2 or torchtitan write it, in shardwise's "
        "format.",
    )
    p.add_argument(
        "ckpt", help="checkpoint directory written by shardwise.save() (--to shardwise: DCP's)"
    )
    p.add_argument("out", help="output directory")
    p.add_argument(
        "--max-shard-bytes",
        type=int,
        default=5 * 2**30,
        help="largest output file, in bytes (default 5 GiB)",
    )
    p.add_argument(
        "--to",
        choices=("hf", "dcp", "shardwise"),
        default="hf",
        help="hf: a Hugging Face style safetensors model (default); dcp: model, optimizer, "
        "step and extra as torch.distributed.checkpoint files, which FSDP2 loads; shardwise: "
        "a DCP directory in shardwise's format (give --model or --hf)",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--model",
        metavar="PKG.MODULE:FACTORY",
        help="--to shardwise: a function that builds the checkpoint's model (called on the "
        "meta device), to tell its parameters from its buffers",
    )
    which.add_argument(
        "--hf", metavar="DIR|config.json", help="--to shardwise: the model's Hugging Face config"
    )
    p.add_argument(
        "--optimizer",
        metavar="NAME",
        help="--to shardwise: the torch.optim class that saved the state (e.g. AdamW), needed "
        "where its hyper-parameters fit several (Adam and AdamW)",
    )
    a = p.parse_args(argv)
    if a.to != "shardwise" and (a.model or a.hf or a.optimizer):
        p.error("--model, --hf and --optimizer go with --to shardwise")
    if a.to == "shardwise" and not (a.model or a.hf):
        p.error(
            "--to shardwise needs the checkpoint's model, to tell its parameters from its "
            "buffers: --model PKG.MODULE:FACTORY or --hf CONFIG_DIR"
        )
    try:
        kw = {"model": _model(a), "optimizer": a.optimizer} if a.to == "shardwise" else {}
        written = convert(a.ckpt, a.out, max_shard_bytes=a.max_shard_bytes, to=a.to, **kw)
    except ShardwiseError as exc:
        raise SystemExit(f"shardwise convert: {exc}") from None
    for path in written:
        print(path)


def _model(a: argparse.Namespace) -> nn.Module | None:
    """The model ``--model`` or ``--hf`` names, built on the meta device, as ``shardwise
    plan`` builds it."""
    if a.model is None and a.hf is None:
        return None
    from ..planner.cli import hf_model, on_meta, resolve

    build = resolve(a.model, "--model") if a.model else hf_model(a.hf, None, 1)[1]
    model = on_meta(build)
    if not isinstance(model, nn.Module):
        raise ShardwiseError(f"--model {a.model} built a {type(model).__name__}, not a module")
    return model
