"""``ShardwiseStrategy``: Lightning's ``Trainer(strategy="shardwise")``.

The LightningModule itself is sharded in place (``shard()`` at ``setup``, after
``configure_model``), so the optimizers ``configure_optimizers`` builds see only this rank's
shards. Every ``*_step`` runs through the module's ``__call__`` (Lightning's forward
redirection), so the root unit's hooks gather what the step uses. Gradient accumulation is
``shardwise.no_sync``; clipping and ``precision=`` are ``ShardwisePrecision``'s; checkpoints are
``shardwise.save``/``shardwise.load`` directories holding Lightning's own state too.
"""

from __future__ import annotations

import base64
import io
import shutil
from collections.abc import Generator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.cloud_io import _load
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from ..api import no_sync
from ..checkpoint import load, save
from ..checkpoint.commit import is_complete
from ..core import collectives as C
from ..core import groups
from ..core.errors import ShardwiseError
from ..core.policies import MixedPrecision, Sharding
from ..options import ShardOptions, is_sharded, mixed_precision_of, shard_with
from .precision import ShardwisePrecision, plugin_of

_META_KEY = "lightning"  # the checkpoint's ``extra`` key holding Lightning's state


class ShardwiseStrategy(ParallelStrategy):
    """Fully sharded data parallel training with shardwise, for ``lightning.Trainer``.

    ``Trainer(strategy="shardwise")`` takes the defaults (units by ``wrap.auto``, full_shard);
    ``Trainer(strategy=ShardwiseStrategy(...))`` takes ``shard()``'s options: wrap (a policy or
    a set of module classes), strategy ("full_shard", "shard_grad_op", "no_shard",
    "hybrid_shard", "hybrid_shard_grad_op"), mixed_precision (or Trainer's ``precision=``),
    cpu_offload, placement, comm, max_unsharded, shard_size, memory_budget (planned with the
    module's ``example_input_array``) and activation_checkpointing (a policy or classes).
    timeout: collectives that cannot complete raise after it on every rank.

    Runs on CPU (Gloo) and CUDA (NCCL), launched by Lightning (``devices=N``) or torchrun.
    Options it cannot honour raise when the Trainer is built or set up, naming the option.
    """

    strategy_name = "shardwise"

    def __init__(
        self,
        *,
        wrap=None,
        strategy: str | None = None,
        mixed_precision: MixedPrecision | str | None = None,
        cpu_offload: bool = False,
        placement=None,
        comm=None,
        max_unsharded: int = 2,
        shard_size: int | None = None,
        memory_budget: int | str | None = None,
        activation_checkpointing=None,
        timeout: timedelta = timedelta(seconds=groups.DEFAULT_TIMEOUT_S),
        accelerator=None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment=None,
        precision_plugin: Precision | None = None,
    ) -> None:
        self.options = ShardOptions(  # first: the precision setter below reads it
            wrap=wrap, strategy=strategy, mixed_precision=mixed_precision, cpu_offload=cpu_offload,
            placement=placement, comm=comm, max_unsharded=max_unsharded, shard_size=shard_size,
            memory_budget=memory_budget, activation_checkpointing=activation_checkpointing,
        )
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices,
            cluster_environment=cluster_environment, precision_plugin=precision_plugin,
        )
        self._timeout = timeout
        self.num_nodes = 1

    # --- what Lightning may set, checked as it is set (so the Trainer's constructor raises)
    @property
    def accelerator(self):
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator) -> None:
        if accelerator is not None and not isinstance(accelerator, (CPUAccelerator, CUDAAccelerator)):
            raise ShardwiseError(
                f"Trainer(accelerator=...) chose {type(accelerator).__name__}, which ShardwiseStrategy "
                "cannot run on: it runs on 'cpu' (Gloo) and 'cuda' (NCCL)"
            )
        self._accelerator = accelerator

    @property
    def precision_plugin(self) -> ShardwisePrecision:
        return self._precision_plugin if self._precision_plugin is not None else ShardwisePrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = plugin_of(plugin) if plugin is not None else None
        if self._precision_plugin is not None:
            self._mixed_precision()  # a clash with mixed_precision= raises now

    @property
    def checkpoint_io(self):
        return super().checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io_plugin) -> None:
        if io_plugin is not None:
            raise ShardwiseError(
                f"Trainer(plugins=[{type(io_plugin).__name__}(...)]): ShardwiseStrategy writes "
                "shardwise's sharded checkpoints itself (each rank its rows), so a CheckpointIO "
                "plugin would not be used; remove it"
            )
        self._checkpoint_io = None

    def _mixed_precision(self) -> MixedPrecision | str | None:
        """shard()'s mixed precision: the strategy's option, or else Trainer's ``precision=``."""
        flag = self.precision_plugin.precision
        return mixed_precision_of(
            self.options.mixed_precision, None if flag == "32-true" else f"Trainer(precision={flag!r})",
            self.precision_plugin.mixed_precision, owner="ShardwiseStrategy",
        )

    # --- devices, ranks, launch
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:  # the Trainer then gives each rank its part of the data
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:  # else torchrun, Slurm, ...
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        super().setup_environment()
        if self._layer_sync is not None:
            raise ShardwiseError(
                "Trainer(sync_batchnorm=True) is not supported by ShardwiseStrategy: its forward "
                "collectives would interleave with the units' gathers; use LayerNorm/GroupNorm, or "
                "strategy='ddp'"
            )
        reset_seed()
        self.set_world_ranks()
        backend = _get_default_process_group_backend_for_device(self.root_device)
        device_id = self.root_device if self.root_device.type == "cuda" else None
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout, device_id=device_id)

    # --- the module: sharded once, at the first setup
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # built on the host (or the meta device with empty_init): shard() moves each rank's
        # rows to the device, so the whole model never sits there
        with torch.device("meta") if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    def model_to_device(self) -> None:
        pass  # shard() placed the shards; nothing else may move them

    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if not is_sharded(module):
            module = self.precision_plugin.convert_module(module)
            example = _example_inputs(module)
            if self.options.memory_budget is not None and example is None:
                raise ShardwiseError(
                    f"ShardwiseStrategy(memory_budget={self.options.memory_budget!r}) plans a "
                    "training step of the module's forward with its example_input_array: set "
                    "self.example_input_array (one micro-batch) in the LightningModule's __init__"
                )
            options = self.options
            if options.shard_size is None and Sharding.of(options.strategy or "full_shard").hybrid:
                options = replace(options, shard_size=self.num_processes)  # a node's devices
            shard_with(module, options, mixed_precision=self._mixed_precision(), example_inputs=example)
        self.model = module
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def block_backward_sync(self) -> AbstractContextManager:
        """Gradient accumulation: backwards inside reduce nothing (``shardwise.no_sync``)."""
        return no_sync(self.model)

    # every step through the module's __call__, so the root unit's hooks run around it
    def training_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.train_step_context():
            return self._forward_redirection(self.model, self.lightning_module, "training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.val_step_context():
            return self._forward_redirection(self.model, self.lightning_module, "validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.test_step_context():
            return self._forward_redirection(self.model, self.lightning_module, "test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.predict_step_context():
            return self._forward_redirection(self.model, self.lightning_module, "predict_step", *args, **kwargs)

    # --- collectives Lightning asks for
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        devices = {"device_ids": [self.root_device.index]} if groups.backend() == "nccl" else {}
        C.blocking("barrier", f"Lightning barrier {name or ''}".rstrip(), dist.barrier, **devices)

    def broadcast(self, obj, src: int = 0):
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        C.blocking("broadcast", "Lightning broadcast", dist.broadcast_object_list, box, src)
        return box[0]

    def reduce(self, tensor, group=None, reduce_op="mean"):
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # --- checkpoints: one shardwise checkpoint directory per Lightning checkpoint
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # shardwise.load needs the sharded module and its optimizers

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restored them

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the shards go into the checkpoint directory, not into Lightning's dict

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return {}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint loaded the shards

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options=None) -> None:
        """Collective: ``shardwise.save`` of the module and optimizers into the directory
        ``filepath``; the rest of Lightning's checkpoint (loops, callbacks, schedulers, hyper-
        parameters) travels in its index, so the directory is complete or absent, never half."""
        if storage_options is not None:
            raise ShardwiseError(
                "trainer.save_checkpoint(..., storage_options=...) is not supported by "
                "ShardwiseStrategy, which writes shardwise checkpoint directories itself"
            )
        path = Path(self.broadcast(str(filepath)))
        checkpoint.pop("state_dict", None)
        with_optimizers = checkpoint.pop("optimizer_states", None) is not None
        optimizers = [_unwrap(o) for o in self.optimizers] if with_optimizers and self.optimizers else None
        extra = {_META_KEY: _encode(checkpoint)} if self.is_global_zero else None
        save(path, self.model, optimizers, step=checkpoint.get("global_step"), extra=extra)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Collective: ``shardwise.load`` into the sharded module (and, when fitting, its
        optimizers), at any world size; returns Lightning's state for the rest."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if not path.exists():
            raise FileNotFoundError(f"ckpt_path={str(path)!r} does not exist")
        if not is_complete(path):
            raise ShardwiseError(
                f"ckpt_path={str(path)!r} is not a checkpoint written by ShardwiseStrategy (a "
                "directory with index.json and COMMITTED). A checkpoint of another strategy holds "
                "whole tensors: load its 'state_dict' into the module before fit(), and resume from "
                "checkpoints this strategy writes"
            )
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        optimizers = [_unwrap(o) for o in self.optimizers] if fitting and self.optimizers else None
        info = load(path, self.model, optimizers)
        meta = (info.extra or {}).get(_META_KEY)
        if meta is None:
            raise ShardwiseError(
                f"{path} is a shardwise checkpoint without Lightning's state (written by "
                "shardwise.save, not trainer.save_checkpoint): load it with shardwise.load(path, "
                "module) before fit() instead of passing ckpt_path"
            )
        checkpoint = _decode(meta, weights_only)
        checkpoint["state_dict"] = {}
        return checkpoint

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)

    def teardown(self) -> None:
        # unlike the base strategy, the module is not moved to the host: its parameters are
        # views of the units' flat shards
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            "shardwise", cls, description="Fully sharded data parallel training with shardwise"
        )


def _unwrap(optimizer):
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _encode(state: dict[str, Any]) -> str:
    """Lightning's checkpoint dict (tensors, hyper-parameters, callback state) as text for the
    index's JSON ``extra``."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _decode(text: str, weights_only: bool | None) -> dict[str, Any]:
    return _load(io.BytesIO(base64.b64decode(text)), map_location="cpu", weights_only=weights_only)


def _example_inputs(module):
    """The module's ``example_input_array`` as the planner's micro-batch (shapes only: the
    planner calls it under FakeTensorMode), or None."""
    example = getattr(module, "example_input_array", None)
    if example is None:
        return None
    args = example if isinstance(example, tuple) else (example,)
    if any(not isinstance(a, torch.Tensor) for a in args):
        raise ShardwiseError(
            "memory_budget plans with the module's example_input_array, which must be a tensor "
            "or a tuple of tensors (the forward's positional arguments)"
        )
    return lambda: tuple(torch.empty_like(a) for a in args)
