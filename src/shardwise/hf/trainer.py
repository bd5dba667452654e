"""``shardwise.hf.Trainer``: transformers' ``Trainer`` training a model sharded by shardwise.

What changes, and where transformers gives no public hook (docs/frameworks.md lists the
file:line of each): the model is sharded in ``__init__`` (or arrives sharded); the accelerator
transformers builds leaves it unwrapped (``ShardwiseAccelerator``, through the public
``create_accelerator_and_postprocess``); ``save_model`` writes ``shardwise.save_pretrained``'s
directory; and a checkpoint's model and optimizer state are a shardwise checkpoint in
``checkpoint-N/shardwise``, written and read by overriding the Trainer's private
``_save_optimizer_and_scheduler``, ``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``
and ``_load_best_model`` (transformers has no public hook there: each of them hard-codes the
engines it knows and otherwise saves rank 0's optimizer state and loads whole tensors).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME

from ..checkpoint import load, load_full, save, save_pretrained
from ..checkpoint.commit import is_complete
from ..core.errors import ShardwiseError
from ..core.groups import init
from ..core.runtime import runtime_of
from ..options import ShardOptions, is_sharded, mixed_precision_of, shard_with
from .accelerator import ShardwiseAccelerator

SHARDS_DIR = "shardwise"  # in each checkpoint-N: the model's and optimizer's shards

# transformers.Trainer's methods overridden here; the private ones have no public equivalent
OVERRIDDEN = (
    "create_accelerator_and_postprocess", "save_model", "_save_optimizer_and_scheduler",
    "_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_best_model",
)
if missing := [name for name in OVERRIDDEN if not hasattr(transformers.Trainer, name)]:
    raise ImportError(
        f"shardwise.hf.Trainer overrides transformers.Trainer.{', '.join(missing)}, which transformers "
        f"{transformers.__version__} does not have: install the version pinned in shardwise's [hf] extra"
    )


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` for a model sharded by shardwise, launched by torchrun.

    Pass a model as for ``transformers.Trainer``: one not yet sharded is sharded here with
    ``shard_options`` (a ``shardwise.ShardOptions``; default: units by ``wrap.auto``, full_shard;
    ``args.bf16`` is shardwise's ``mixed_precision="bf16"``), or shard it yourself first
    (``shardwise.shard``, e.g. on the meta device with ``init_from=``). Build your own optimizer,
    if any, after that, from ``model.parameters()``.

    ``save_model`` writes a ``from_pretrained`` directory (``shardwise.save_pretrained``), so
    does every checkpoint, beside ``shardwise/``: the sharded model and optimizer, which
    ``train(resume_from_checkpoint=...)`` loads at any world size. Gradient accumulation runs
    under ``shardwise.no_sync``; ``max_grad_norm`` clips the global norm.

    TrainingArguments this cannot honour raise here: fp16 (use bf16), fsdp, deepspeed,
    torch_compile, gradient_checkpointing (use ``ShardOptions(activation_checkpointing=...)``),
    and ``model_init``.
    """

    def __init__(self, model=None, args=None, *, shard_options: ShardOptions | None = None, **kwargs):
        if model is None or kwargs.get("model_init") is not None:
            raise ShardwiseError(
                "shardwise.hf.Trainer needs model= (model_init is not supported: the model is "
                "sharded once, when the Trainer is built)"
            )
        if args is None:
            args = transformers.TrainingArguments(output_dir="trainer_output")
        _check_args(args)
        _ = args.device  # accelerate joins torchrun's process group here
        _check_parallel(args)
        if not dist.is_initialized():  # one process, no torchrun
            init()
        if is_sharded(model):
            if shard_options is not None:
                raise ShardwiseError(
                    "the model is already sharded: shard_options would not be applied; pass one or the other"
                )
            _check_precision(model, args)
        else:
            options = shard_options or ShardOptions()
            flag = "TrainingArguments(bf16=True)" if args.bf16 else None
            precision = mixed_precision_of(options.mixed_precision, flag, "bf16" if args.bf16 else None, owner="ShardOptions")
            shard_with(model, options, mixed_precision=precision)
        super().__init__(model=model, args=args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        ShardwiseAccelerator.specialise(self.accelerator)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective: a ``from_pretrained`` directory, each rank sending one unit at a time to
        rank 0, which writes it (plus the tokenizer and the training arguments, as transformers
        does)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        save_pretrained(self.model, output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    # --- checkpoints: private methods of transformers.Trainer (no public hook; see module doc)
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save(Path(output_dir) / SHARDS_DIR, self.model, _unwrap(self.optimizer), step=self.state.global_step)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        shards = Path(resume_from_checkpoint) / SHARDS_DIR
        if is_complete(shards):
            load(shards, self.model)
        else:  # a checkpoint saved with save_only_model: the from_pretrained directory
            load_full(self.model, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        shards = Path(checkpoint) / SHARDS_DIR
        if not is_complete(shards):
            raise ShardwiseError(
                f"{checkpoint} holds no optimizer state ({SHARDS_DIR}/ is missing: saved with "
                "save_only_model=True?); resume from a full checkpoint"
            )
        load(shards, self.model, _unwrap(self.optimizer))
        self.lr_scheduler.load_state_dict(
            torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True)
        )

    def _load_best_model(self) -> None:
        self._load_from_checkpoint(self.state.best_model_checkpoint)


def _unwrap(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer


def _check_args(args) -> None:
    """Refuse, naming it, each TrainingArguments setting this Trainer would otherwise ignore."""
    refused = {
        "fp16": "fp16 needs loss scaling agreed by all ranks, which accelerate's scaler is not: use bf16=True",
        "fsdp": "the model is sharded by shardwise: drop fsdp",
        "deepspeed": "the model is sharded by shardwise: drop deepspeed",
        "torch_compile": "compile blocks yourself after sharding (block.compile()), as docs/frameworks.md shows",
        "gradient_checkpointing": "transformers' checkpointing would run the units' hooks inside the "
        "recomputed region: use shard_options=ShardOptions(activation_checkpointing={DecoderLayer})",
    }
    for name, why in refused.items():
        if getattr(args, name, None):
            raise ShardwiseError(f"TrainingArguments({name}=...) is not supported by shardwise.hf.Trainer: {why}")


def _check_parallel(args) -> None:
    """Under torchrun, transformers must train the processes as one data-parallel job."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and args.parallel_mode != transformers.training_args.ParallelMode.DISTRIBUTED:
        raise ShardwiseError(
            f"torchrun started {world} processes, but transformers does not train them as one job "
            f"(TrainingArguments.parallel_mode is {args.parallel_mode.value}): on a machine without "
            "CUDA pass TrainingArguments(use_cpu=True), which makes accelerate join them over Gloo"
        )


def _check_precision(model, args) -> None:
    dtype = runtime_of(model).precision.param_dtype
    if args.bf16 and dtype != torch.bfloat16:
        raise ShardwiseError(
            "TrainingArguments(bf16=True), but the model was sharded without mixed_precision='bf16': "
            "shard it with mixed_precision='bf16', or drop bf16"
        )
