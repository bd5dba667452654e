"""A save in flight: ``SaveHandle``, what ``save`` returns, and each model's one background
save, which the next save or load of the model first waits for. Apart from saving.py so that
both formats' saves (shardwise's own, DCP) and the loads share it without importing each other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.nn as nn

from .index import CheckpointError


class SaveHandle:
    """A save, finished or still being written: ``wait()`` returns the checkpoint's path once
    it is committed, or raises the CheckpointError that stopped it (on every rank alike)."""

    def __init__(self, path: Path):
        self.path = path
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._reported = False

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            self._reported = True
            raise self._error
        return self.path

    def start(self, work: Callable[[], None]) -> None:
        """Run ``work`` (the writes and the commit) in a background thread."""
        self._thread = threading.Thread(target=self._run, args=(work,), name=f"shardwise-save:{self.path.name}")
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as e:  # kept for wait(); a thread has nobody else to tell
            self._error = e


@dataclass
class Saves:
    """A model's background save in flight (at most one) and the Gloo group such saves use."""

    pending: SaveHandle | None = None
    group: Any = None


def saves_of(model: nn.Module) -> Saves:
    if "_shardwise_saves" not in model.__dict__:
        model._shardwise_saves = Saves()
    return model._shardwise_saves


def finish_pending(model: nn.Module) -> None:
    """Wait for the model's background save; raise its error unless ``wait()`` reported it."""
    saves = saves_of(model)
    handle, saves.pending = saves.pending, None
    if handle is None:
        return
    handle._thread.join()
    if handle._error is not None and not handle._reported:
        raise CheckpointError(
            f"the background save to {handle.path} failed: {handle._error}"
        ) from handle._error
