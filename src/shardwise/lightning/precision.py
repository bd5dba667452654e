"""``ShardwisePrecision``: Lightning's ``precision=`` on a sharded module. Mixed precision is
shardwise's (16-bit gathers and compute, fp32 reductions and master shards), fp16 loss scaling
is ``shardwise.GradScaler`` (one skip verdict for all ranks), and clipping by norm takes the
global norm of the shards (``shardwise.clip_grad_norm_``)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn as nn
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities import apply_to_collection

from ..api import clip_grad_norm_
from ..core.errors import ShardwiseError
from ..core.runtime import runtime_of
from ..core.scaler import GradScaler

# Lightning's precision flag -> shardwise's mixed_precision (None: the parameters' own dtype)
MIXED = {"32-true": None, "bf16-mixed": "bf16", "16-mixed": "fp16", "bf16-true": None}
UNSUPPORTED = {
    "16-true": "fp16 weights without loss scaling underflow; use precision='16-mixed' (fp16 "
    "compute, fp32 master shards and shardwise.GradScaler) or 'bf16-true'",
    "64-true": "use precision='32-true'",
}


class ShardwisePrecision(Precision):
    """Lightning's precision flags on a module sharded by ``ShardwiseStrategy``.

    "32-true": as is. "bf16-mixed": shardwise's ``mixed_precision="bf16"`` (units gathered and
    computed in bf16, gradients reduced in fp32 onto fp32 master shards; no autocast).
    "16-mixed": ``mixed_precision="fp16"`` with ``shardwise.GradScaler``. "bf16-true": the module
    converted to bf16 before sharding (shards and optimizer state in bf16).
    """

    def __init__(self, precision: str = "32-true") -> None:
        if precision in UNSUPPORTED:
            raise ShardwiseError(
                f"precision={precision!r} is not supported by ShardwiseStrategy: {UNSUPPORTED[precision]}"
            )
        if precision not in MIXED:
            raise ShardwiseError(
                f"precision={precision!r} is not supported by ShardwiseStrategy; use one of {tuple(MIXED)}"
            )
        self.precision = precision
        self.scaler: GradScaler | None = None
        self._module: nn.Module | None = None

    @property
    def mixed_precision(self) -> str | None:
        """What this flag asks of ``shard(mixed_precision=...)``."""
        return MIXED[self.precision]

    @property
    def _true_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.precision == "bf16-true" else None

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(self._true_dtype) if self._true_dtype is not None else module

    def tensor_init_context(self) -> AbstractContextManager:
        return _DtypeContextManager(self._true_dtype) if self._true_dtype is not None else nullcontext()

    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    def forward_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    def convert_input(self, data: Any) -> Any:
        if self._true_dtype is None:  # mixed: the root unit casts floating inputs itself
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=self._true_dtype)

    def convert_output(self, data: Any) -> Any:
        if self._true_dtype is None:
            return data
        dtype = torch.get_default_dtype()
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=dtype)

    def connect(self, model: nn.Module, optimizers: list, lr_schedulers: list) -> tuple:
        """Called by the strategy once the module is sharded."""
        self._module = model
        if runtime_of(model).precision.needs_loss_scaling and self.scaler is None:
            self.scaler = GradScaler(model)
        return model, optimizers, lr_schedulers

    def pre_backward(self, tensor: torch.Tensor, module) -> torch.Tensor:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        skipped = closure_result is None and model.automatic_optimization  # training_step gave None
        if not skipped:
            self.scaler.unscale_(optimizer)  # before clipping, as with torch.amp's scaler
        self._after_closure(model, optimizer)
        if skipped:
            return closure_result
        self.scaler.step(optimizer)
        self.scaler.update()
        return closure_result

    def clip_grad_by_norm(self, optimizer, clip_val: float) -> None:
        """The global norm of the module's gradients (all ranks' shards), as DDP clips."""
        assert self._module is not None, "connect() runs before any step"
        stepped = {id(p) for p in self.main_params(optimizer) if p.grad is not None}
        with_grads = {id(p) for p in self._module.parameters() if p.grad is not None}
        if stepped != with_grads:
            raise ShardwiseError(
                "gradient_clip_algorithm='norm' clips the norm of all of the module's gradients, but "
                f"this optimizer steps {len(stepped)} of the {len(with_grads)} parameters that have "
                "one: clip once for all optimizers, or by value (gradient_clip_algorithm='value')"
            )
        clip_grad_norm_(self._module, clip_val)

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


def plugin_of(plugin: Precision | None) -> ShardwisePrecision:
    """The ``ShardwisePrecision`` that stands for the plugin Lightning built from ``precision=``
    (or one given in ``plugins=``); any other raises, naming it."""
    if plugin is None or isinstance(plugin, ShardwisePrecision):
        return plugin or ShardwisePrecision()
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision

    known = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)  # what precision= builds
    if type(plugin) in known:
        return ShardwisePrecision(getattr(plugin, "precision", "32-true"))
    raise ShardwiseError(
        f"the precision plugin {type(plugin).__name__} (Trainer(plugins=...) or precision=) is not "
        "supported by ShardwiseStrategy: use Trainer(precision='32-true' | 'bf16-mixed' | "
        "'16-mixed' | 'bf16-true'), or plugins=[shardwise.lightning.ShardwisePrecision(...)]"
    )

