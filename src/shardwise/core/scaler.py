"""Loss scaling for fp16 on sharded gradients, with one verdict for all ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from . import collectives as C
from .runtime import runtime_of


class GradScaler:
    """Dynamic loss scaling for ``mixed_precision="fp16"``.

    Each rank checks only its own gradient shards for inf/NaN, so the verdict is all-reduced
    (MAX) before anyone steps: either every rank skips the step and lowers the scale, or every
    rank takes it. Use it like torch.amp.GradScaler:
    ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        self.runtime = runtime_of(model)
        self.runtime.grad_scaler = self
        self.model = model
        self.scale_value = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self._good_steps = 0
        self._unscaled: set[int] = set()
        self._found_inf: dict[int, bool] = {}

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def get_scale(self) -> float:
        return self.scale_value

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale and agree across ranks whether any is not finite."""
        if id(optimizer) in self._unscaled:
            return
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        found = torch.zeros(1, device=device)
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale_value)
            found = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any().float().reshape(1)
        group = self.runtime.units[0].group
        if dist.get_world_size(group) > 1:
            C.all_reduce(found, group, "grad_scaler", op=dist.ReduceOp.MAX).wait()
        self._found_inf[id(optimizer)] = bool(found.item())
        self._unscaled.add(id(optimizer))

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step ``optimizer`` unless some rank found inf/NaN; returns whether it stepped."""
        self.unscale_(optimizer)
        if self._found_inf[id(optimizer)]:
            # error feedback residuals kept what encoding dropped from this step's rows, which
            # were not finite: carried on, they would make every later step's rows so too
            for unit in self.runtime.units:
                unit.residuals.clear()
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Lower the scale after a skipped step; raise it after ``growth_interval`` good ones."""
        if any(self._found_inf.values()):
            self.scale_value *= self.backoff_factor
            self._good_steps = 0
        else:
            self._good_steps += 1
            if self._good_steps == self.growth_interval:
                self.scale_value *= self.growth_factor
                self._good_steps = 0
        self._unscaled.clear()
        self._found_inf.clear()

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale_value, self._good_steps = float(state["scale"]), int(state["good_steps"])
