"""The explorer's task: 2-D points of three classes in interleaved spiral arms, and a small
MLP of residual blocks (each block a unit) that learns to tell them apart. Its answer can be
drawn: the class the model predicts at every point of the plane."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

CLASSES = 3
POINTS = 240  # the global batch: every point, every step (divisible by 1-4 ranks)
HIDDEN = 48
BLOCKS = 3
GRID = 40  # the decision regions are drawn on GRID x GRID points
EXTENT = 1.25  # the plane shown: [-EXTENT, EXTENT]^2


def points(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``POINTS`` points (x, y) and their class: spiral arms with noise, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    per = POINTS // CLASSES
    radius = torch.linspace(0.1, 1.0, per).repeat(CLASSES)
    label = torch.arange(CLASSES).repeat_interleave(per)
    turn = float(torch.rand((), generator=g)) * 2 * math.pi
    angle = label * (2 * math.pi / CLASSES) + radius * 3.0 + turn
    angle = angle + 0.2 * torch.randn(POINTS, generator=g)
    xy = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    return xy, label


def grid() -> torch.Tensor:
    """The plane's sample points, row by row from the top (y = EXTENT) down."""
    axis = torch.linspace(-EXTENT, EXTENT, GRID)
    y, x = torch.meshgrid(axis.flip(0), axis, indexing="ij")
    return torch.stack([x.reshape(-1), y.reshape(-1)], dim=1)


class Block(nn.Module):
    """A residual block: x + W2 gelu(W1 x)."""

    def __init__(self, width: int):
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Net(nn.Module):
    """(x, y) -> class logits: an input layer, ``BLOCKS`` blocks and a head."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(2, HIDDEN)
        self.blocks = nn.ModuleList(Block(HIDDEN) for _ in range(BLOCKS))
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, xy: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(xy))
        for b in self.blocks:
            h = b(h)
        return self.head(h)
