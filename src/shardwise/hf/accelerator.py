"""``ShardwiseAccelerator``: the accelerate ``Accelerator`` that transformers' Trainer drives,
specialised for a model sharded by shardwise. It overrides three public methods, where the
stock one would wrap or sum the shards as if they were whole parameters:

- ``prepare_model``: a sharded model is returned as it is. The stock one wraps every model with
  trainable parameters in ``DistributedDataParallel`` when several processes run
  (accelerate/accelerator.py, ``prepare_model``: "if any(p.requires_grad ...)"), which would
  broadcast rank 0's shards over the others' and all-reduce gradients shardwise already reduced.
- ``no_sync``: ``shardwise.no_sync`` (the stock one looks for the model's ``no_sync`` method, which
  DDP has and a sharded module has not).
- ``clip_grad_norm_``: the global norm of all ranks' shards (``shardwise.clip_grad_norm_``); the
  stock one is ``torch.nn.utils.clip_grad_norm_`` of this rank's shards only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.nn as nn
from accelerate import Accelerator

from ..api import clip_grad_norm_, no_sync
from ..core.errors import ShardwiseError
from ..options import is_sharded


class ShardwiseAccelerator(Accelerator):
    """An ``Accelerator`` whose sharded model is left unwrapped, accumulates under
    ``shardwise.no_sync`` and is clipped by its global norm. Models that shardwise did not
    shard go through accelerate as usual."""

    _shardwise_model: nn.Module | None = None

    @classmethod
    def specialise(cls, accelerator: Accelerator) -> ShardwiseAccelerator:
        """The accelerator transformers built (its state, plugins and settings untouched),
        with this class's methods: only methods are added, so nothing is copied or lost."""
        accelerator.__class__ = cls
        return accelerator

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        if not is_sharded(model):
            return super().prepare_model(model, device_placement, evaluation_mode)
        if self._shardwise_model is not None and self._shardwise_model is not model:
            raise ShardwiseError("shardwise.hf.Trainer trains one sharded model; a second was prepared")
        self._shardwise_model = model  # no DDP, no autocast, no device move: shard() did its part
        return model

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        if not is_sharded(model):
            with super().no_sync(model):
                yield
            return
        with no_sync(model):
            yield

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2):
        model = self._shardwise_model
        if model is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        given = {id(p) for p in parameters}
        if not {id(p) for p in model.parameters() if p.grad is not None} <= given:
            raise ShardwiseError(
                "clip_grad_norm_ of part of a sharded model's parameters: shardwise clips the "
                "global norm of all of the model's gradients (pass model.parameters())"
            )
        self.unscale_gradients()
        return clip_grad_norm_(model, max_norm, norm_type)
