"""Observation points of the life cycle, for tracers: nothing is recorded unless one listens.

Events (``name``, ``unit`` label, fields): ``forward`` / ``backward`` with ``edge`` "begin" or
"end" (a unit's compute in each pass), ``gather_issue`` / ``gather_done`` / ``reshard``,
``reduce_issue`` / ``reduce_done`` (``bytes``), ``collective`` (``kind``, ``bytes``,
``t_issue``, ``wait_s``: emitted when a collective completes), ``step_end``, and
``activations`` (``host``: bytes of offloaded activations in host memory from here on; Note
[host copies] in activation_offload.py). Every event
carries ``t`` (time.perf_counter() seconds). The check ``if listeners`` is all it costs when off.
"""

from __future__ import annotations

import time
from collections.abc import Callable

Listener = Callable[..., None]
listeners: list[Listener] = []


def listen(fn: Listener) -> None:
    """Call ``fn(name, unit, t=..., **fields)`` for every event until ``unlisten(fn)``."""
    listeners.append(fn)


def unlisten(fn: Listener) -> None:
    listeners.remove(fn)


def emit(name: str, unit: str, **fields) -> None:
    t = time.perf_counter()
    for fn in listeners:
        fn(name, unit, t=t, **fields)
