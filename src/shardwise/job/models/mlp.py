"""A stack of Linear layers for benchmarks: many same-shaped units, some optionally frozen."""

from __future__ import annotations

import torch
import torch.nn as nn


class Layer(nn.Module):
    """Linear followed by GELU, or a plain Linear when ``activation`` is False."""

    def __init__(self, d_in: int, d_out: int, activation: bool = True):
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        self.act = nn.GELU() if activation else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x))


class MLPStack(nn.Module):
    """Layers mapping ``dims[i]`` to ``dims[i + 1]``; the last has no activation.

    Layers whose index is in ``frozen`` do not require gradients (a mix of trainable and
    frozen parameters, as in fine-tuning).
    """

    def __init__(self, dims: list[int], frozen: tuple[int, ...] = ()):
        super().__init__()
        if len(dims) < 2:
            raise ValueError(f"dims needs at least an input and an output width, got {dims}")
        n = len(dims) - 1
        if bad := [i for i in frozen if not 0 <= i < n]:
            raise ValueError(f"frozen layer indices {bad} are outside 0..{n - 1}")
        self.layers = nn.ModuleList(
            Layer(dims[i], dims[i + 1], activation=i < n - 1) for i in range(n)
        )
        for i in frozen:
            self.layers[i].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x
