"""Where the explorer's ranks run: one GPU each under NCCL when this machine has enough of
them, else the CPU under Gloo. Chosen once per job; every rank chooses the same (they see the
same machine), and everything downstream (the model, the data, the planner's prediction, the
tracer's memory figures) reads the choice."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Machine:
    """device: "cuda" (rank r on cuda:r) or "cpu"; backend: the collectives', "nccl" or "gloo"."""

    device: str
    backend: str

    def describe(self) -> str:
        return f"{self.device} ({self.backend})"


CPU = Machine("cpu", "gloo")
GPU = Machine("cuda", "nccl")


def choose(ranks: int) -> Machine:
    """One GPU per rank when CUDA has ``ranks`` of them, else the CPU for all."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= ranks:
        return GPU
    return CPU
