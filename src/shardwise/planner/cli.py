"""``shardwise plan``: the planner from the command line, on any model.

    shardwise plan --hf ./Llama-2-7b-hf --world-size 64 --backend nccl --mixed-precision bf16
    shardwise plan --model mypkg.models:build --inputs mypkg.models:batch --loss mypkg.models:loss
    shardwise plan --model-size small --budget 100MiB --json

The model is the built-in GPT (``--model-size``), a function of the user's (``--model``, called
with no arguments under ``torch.device("meta")``) or a Hugging Face config (``--hf``: a local
directory holding config.json, or the file itself; read with ``AutoConfig``, nothing is
downloaded, no weights are read). Its units are its repeated block (``wrap.auto``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

from ..core import placement as placements
from ..core.errors import ShardwiseError
from ..core.policies import Sharding
from ..core.wrap import auto, by_size
from .plan import plan
from .render import as_dict

SIZES = ("tiny", "small", "medium", "large")


def main(argv: list[str] | None = None) -> None:
    a = _parser().parse_args(argv)
    try:
        name, build, inputs, loss, seq_len = _model(a)
        result = plan(build, **_options(a, build, inputs, loss, seq_len))
    except ShardwiseError as exc:
        raise SystemExit(f"shardwise plan: {exc}") from None
    if a.json:
        print(json.dumps({"model": name, **as_dict(result)}, indent=1))
    else:
        print(f"{name}: {result}")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="shardwise plan",
        description="predict per-rank memory and bytes sent of a training step before launch (no GPU needed)",
    )
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--model-size", choices=SIZES, help="the built-in GPT (the default: small)")
    which.add_argument("--model", metavar="PKG.MODULE:FACTORY", help="a function that builds your model")
    which.add_argument("--hf", metavar="DIR|config.json", help="a Hugging Face config, read locally")
    ap.add_argument("--inputs", metavar="PKG.MODULE:FN", help="a function returning the micro-batch: a tuple of positional arguments or a dict of keyword arguments")
    ap.add_argument("--loss", metavar="PKG.MODULE:FN", help="loss(model, *inputs()) -> tensor, for a loss computed outside the model")
    ap.add_argument("--frees-output", action="store_true", help="the training loop drops the model's output before backward (HF Trainer, Lightning); by default it holds it to the step's end")
    ap.add_argument("--world-size", type=int, default=2, help="ranks")
    ap.add_argument("--backend", choices=("gloo", "nccl"), help="the run's collectives (default: nccl where CUDA is available, else gloo)")
    ap.add_argument("--strategy", choices=[s.value for s in Sharding], help="one strategy (default: full_shard, shard_grad_op and no_shard side by side)")
    ap.add_argument("--shard-size", type=int, help="hybrid strategies: ranks per shard group")
    ap.add_argument("--wrap", choices=("auto", "size", "none"), default="auto", help="units: the model's repeated block (auto), by size (1M parameters), or the root alone")
    ap.add_argument("--batch-size", type=int, default=None, help="sequences per rank per step (default 4 for the built-in GPT, else 1)")
    ap.add_argument("--seq-len", type=int, help="tokens per sequence (default: 64 for the built-in GPT; for --hf, 2048 or the model's longest)")
    ap.add_argument("--mixed-precision", choices=("none", "bf16", "fp16"), default="none")
    ap.add_argument("--cpu-offload", action="store_true")
    ap.add_argument("--activation-checkpointing", action="store_true", help="recompute the units' activations in backward")
    ap.add_argument("--placement", choices=("rows", "matrices"), default="rows", help="matrices: the blocks' matrices owned whole by one rank each (for Muon)")
    ap.add_argument("--comm", choices=("none", "bf16", "fp8", "int8"), default="none", help="precision on the wire of the collectives")
    ap.add_argument("--budget", help="device memory per rank, e.g. 80GiB: the fastest per-unit configuration that fits")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON (stable keys) instead of the table")
    return ap


def _options(a: argparse.Namespace, build, inputs, loss, seq_len) -> dict:
    """plan()'s keyword arguments from the command line."""
    model = on_meta(build)
    wrap = {"auto": lambda: auto(model), "size": lambda: by_size(1_000_000), "none": lambda: None}[a.wrap]()
    default_batch = 4 if a.hf is None and a.model is None else 1
    return dict(
        world_size=a.world_size,
        strategy=a.strategy,
        wrap=wrap,
        mixed_precision=None if a.mixed_precision == "none" else a.mixed_precision,
        cpu_offload=a.cpu_offload,
        activation_checkpointing=wrap if a.activation_checkpointing else None,
        batch_size=a.batch_size or default_batch,
        seq_len=seq_len,
        inputs=inputs,
        loss=loss,
        holds_output=not a.frees_output,
        shard_size=a.shard_size,
        backend=a.backend,
        budget=a.budget,
        placement=placements.matrices if a.placement == "matrices" else None,
        comm=None if a.comm == "none" else a.comm,
        progress=a.budget is not None and importlib.util.find_spec("tqdm") is not None,  # (on stderr)
    )


def _model(a: argparse.Namespace):
    """(name shown, model factory, inputs, loss, seq_len) for the chosen model."""
    inputs, loss = (resolve(a.inputs, "--inputs") if a.inputs else None), (resolve(a.loss, "--loss") if a.loss else None)
    if a.hf is not None:
        name, build, seq_len, batch = hf_model(a.hf, a.seq_len, a.batch_size or 1)
        return name, build, inputs or (None if loss else batch), loss, seq_len
    if a.model is not None:
        return a.model, resolve(a.model, "--model"), inputs, loss, a.seq_len
    from functools import partial

    from ..job.models import GPT, gpt_config

    size = a.model_size or "small"
    seq_len = a.seq_len or 64
    return f"GPT {size}", partial(GPT, gpt_config(size, seq_len=seq_len)), inputs, loss, seq_len


def resolve(spec: str, flag: str) -> Callable:
    """``pkg.module:name`` as a callable (the current directory importable, as ``python -m``)."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ShardwiseError(f"{flag} {spec!r}: write it as pkg.module:function")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ShardwiseError(f"{flag} {spec!r}: {exc}") from exc
    if not callable(obj):
        raise ShardwiseError(f"{flag} {spec!r} is a {type(obj).__name__}, not a function")
    return obj


def hf_model(path: str, seq_len: int | None, batch_size: int):
    """A Hugging Face model from its config alone: (name, factory, seq_len, inputs). The
    micro-batch is ``batch_size`` sequences of token ids with labels (the loss inside)."""
    where = Path(path)
    if not (where / "config.json").is_file() and not (where.is_file() and where.suffix == ".json"):
        raise ShardwiseError(
            f"--hf {path}: not a directory holding config.json nor a .json file (nothing is "
            "downloaded: fetch the config first, e.g. huggingface-cli download MODEL config.json)"
        )
    try:
        import transformers
    except ImportError as exc:
        raise ShardwiseError("--hf needs transformers: pip install 'shardwise[hf]'") from exc
    config = transformers.AutoConfig.from_pretrained(str(where), local_files_only=True)
    cls = _hf_class(transformers, config)
    longest = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    seq_len = seq_len or min(2048, longest or 2048)

    def build() -> nn.Module:
        return cls(config)

    def batch() -> dict:  # as Hugging Face's examples train: model(input_ids=..., labels=...)
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
        return {"input_ids": ids, "labels": ids}

    return f"{cls.__name__} ({where}), {batch_size} x {seq_len} token ids with labels", build, seq_len, batch


def _hf_class(transformers, config) -> type:
    """The model class a config names (``architectures``), else the causal LM (or, for an
    encoder-decoder, the sequence-to-sequence LM) of its model type."""
    for arch in getattr(config, "architectures", None) or ():
        if hasattr(transformers, arch):
            return getattr(transformers, arch)
    auto = (
        transformers.AutoModelForSeq2SeqLM
        if getattr(config, "is_encoder_decoder", False)
        else transformers.AutoModelForCausalLM
    )
    try:
        return auto._model_mapping[type(config)]
    except KeyError as exc:
        raise ShardwiseError(
            f"--hf: no {auto.__name__} for {type(config).__name__}; use --model with a function "
            "that builds it"
        ) from exc


def on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """The model a factory builds, on the meta device (no memory): what its names and shapes are."""
    with torch.device("meta"):
        return build()
