"""One rank of the explorer's job: ``python -m shardwise.explore.rank`` with torchrun's
variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), started by job.py.

It reads commands from stdin, one JSON object a line, and writes what it does to stdout, one
JSON object a line. Reset, stage and quit are obeyed between stages; pause, resume and speed
between events, from the tracer's ``on_event`` (the rank waits there, so a paused run stops
between two events on every rank). When stdin closes, the server is gone: the rank exits.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import traceback
from typing import Any, TextIO

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise
from shardwise.core import groups
from shardwise.observer.accounting import held_bytes, theory_bytes_per_step
from shardwise.observer.trace import summary, trace

from . import task
from .machine import Machine, choose
from .settings import STEPS_PER_STAGE, Settings

# a paused run waits inside a step, its peers inside a collective: no collective timeout may
# end that; a rank that dies is the server's to notice (it stops the job)
COLLECTIVE_TIMEOUT_S = 7 * 24 * 3600.0
LR = 0.01


class Control:
    """The server's commands: a reader thread applies pause, resume and speed at once and
    queues the rest for the main thread."""

    def __init__(self, source: TextIO, sink: TextIO):
        self.sink = sink
        self.commands: queue.Queue[dict] = queue.Queue()
        self.delay = 0.0
        self.paused = False
        self.changed = threading.Condition()
        self._write = threading.Lock()
        threading.Thread(target=self._read, args=(source,), daemon=True).start()

    def _read(self, source: TextIO) -> None:
        for line in source:
            cmd = json.loads(line)
            with self.changed:
                if cmd["cmd"] == "pause":
                    self.paused = True
                elif cmd["cmd"] == "resume":
                    self.paused = False
                elif cmd["cmd"] == "speed":
                    self.delay = float(cmd["delay"])
                else:
                    self.commands.put(cmd)
                self.changed.notify_all()
        os._exit(0)  # stdin closed: the server is gone, and so is this job

    def send(self, message: dict[str, Any]) -> None:
        with self._write:
            self.sink.write(json.dumps(message, separators=(",", ":")) + "\n")
            self.sink.flush()

    def between_events(self) -> None:
        """Wait the speed's delay, then for as long as the run is paused."""
        with self.changed:
            if self.delay > 0:
                self.changed.wait_for(lambda: self.paused, timeout=self.delay)
            self.changed.wait_for(lambda: not self.paused)


class Run:
    """One run on ``machine`` (the process group's): the model sharded with the settings, its
    optimizer, this rank's points."""

    def __init__(self, settings: Settings, seed: int, control: Control, machine: Machine):
        self.settings, self.seed, self.control, self.machine = settings, seed, control, machine
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        device = groups.device()  # cuda:LOCAL_RANK under NCCL, else the CPU
        torch.manual_seed(seed)
        self.model = task.Net()  # built on the CPU (the same values everywhere), placed by shard()
        policy = shardwise.wrap.by_class(task.Block)
        shardwise.shard(self.model, wrap=policy, **settings.shard_options())
        if settings.activation_checkpointing:
            shardwise.checkpoint_activations(self.model, policy)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=LR)
        self.xy, self.label = (t.to(device) for t in task.points(seed))
        self.plane = torch.cat([task.grid().to(device), self.xy])  # where the model view asks
        self.mine = slice(self.rank, None, self.world)  # this rank's share of the global batch
        self.stage = 0
        self.step = 0
        self.units = [u.label for u in shardwise.units(self.model)]
        self.cells = [_cell(u) for u in shardwise.units(self.model)]

    def ready(self) -> None:
        """Announce the run: its units, cells and the planner's prediction (rank 0: the
        data points too)."""
        prediction = self.predict()
        regions = self.regions()  # (collective: every rank runs the forward)
        message = {
            "type": "ready", "rank": self.rank, "seed": self.seed, "settings": self.settings.as_dict(),
            "machine": self.machine.describe(),
            "units": self.units, "cells": self.cells, "plan": prediction,
        }
        if self.rank == 0:
            message["points"] = [[round(a, 4), round(b, 4), c] for (a, b), c in zip(self.xy.tolist(), self.label.tolist())]
            message["grid"] = {"size": task.GRID, "extent": task.EXTENT, **regions}
        self.control.send(message)

    def predict(self) -> dict[str, int]:
        """The planner's prediction for this run (collective: rank 0 plans for all)."""
        s, n = self.settings, task.POINTS // self.world
        policy = shardwise.wrap.by_class(task.Block)
        p = shardwise.plan(
            task.Net,
            world_size=self.world,
            wrap=policy,
            activation_checkpointing=policy if s.activation_checkpointing else None,
            inputs=lambda: (torch.zeros(n, 2), torch.zeros(n, dtype=torch.long)),
            loss=lambda model, xy, label: F.cross_entropy(model(xy), label),
            optimizer=lambda params: torch.optim.Adam(params, lr=LR),
            backend=self.machine.backend,
            **s.shard_options(),
        )
        e = p.estimates[0]
        return {"peak": e.peak, "model_state": e.model_state, "activations": e.activations, "bytes_per_step": e.sent}

    def run_stage(self) -> None:
        """STEPS_PER_STAGE optimizer steps on the whole batch, traced event by event."""
        self.stage += 1
        losses = []
        with trace(self.model, self.opt, on_event=self.on_event) as t:
            for i in range(STEPS_PER_STAGE):
                self.step = i + 1
                loss = F.cross_entropy(self.model(self.xy[self.mine]), self.label[self.mine])
                loss.backward()
                self.opt.step()
                if i == STEPS_PER_STAGE - 1:  # gradients are present until zero_grad
                    held = held_bytes(self.model, self.opt)
                self.opt.zero_grad()
                losses.append(loss.detach().float())
        mean = torch.stack(losses)
        dist.all_reduce(mean)  # the loss of the global batch, step by step
        mine = next(m for m in summary(t.data) if m["rank"] == self.rank and m["device"] == self.machine.device)
        sent = sum(v["bytes"] for v in t.data["ranks"][self.rank]["comm"].values())
        message = {
            "type": "stage", "rank": self.rank, "stage": self.stage,
            "loss": [round(v / self.world, 5) for v in mean.tolist()],
            "held": held,
            "peak": mine["peak"], "at_peak": mine["at_peak"],
            "bytes_per_step": sent // STEPS_PER_STAGE,
            "theory_per_step": theory_bytes_per_step(self.model, self.settings.strategy)["bytes"],
        }
        message.update(self.regions())  # (collective: every rank runs the forward)
        if self.rank != 0:
            del message["classes"], message["confidence"]
        self.cells = [_cell(u) for u in shardwise.units(self.model)]
        self.control.send(message)

    def regions(self) -> dict[str, Any]:
        """The sharded model's own prediction over the plane, and its accuracy on the points."""
        with torch.no_grad():
            probs = self.model(self.plane).float().softmax(-1)
        on_grid, on_points = probs[: task.GRID**2], probs[task.GRID**2 :]
        confidence, classes = on_grid.max(-1)
        return {
            "classes": classes.tolist(),
            "confidence": [round(c, 2) for c in confidence.tolist()],
            "accuracy": round(float((on_points.argmax(-1) == self.label).float().mean()), 4),
        }

    def on_event(self, ev: list) -> None:
        """The tracer's event: the unit's new state (or the optimizer's), sent; then wait."""
        _, name, unit, *rest = ev
        message = {"type": "event", "rank": self.rank, "stage": self.stage, "step": self.step, "name": name, "unit": unit}
        if name == "optimizer":
            message["optimizer"] = rest[0] == "begin"
        elif name == "step_end":  # the root's backward ends here (it has no hook of its own)
            for cell in self.cells:
                cell["compute"] = ""
            message["cells"] = [dict(c) for c in self.cells]
        elif 0 <= unit < len(self.cells):
            cell = self.cells[unit]
            if name in _PARAMS and cell["params"] != "whole":
                cell["params"] = _PARAMS[name]
            elif name in ("forward", "backward"):
                cell["compute"] = name if rest[0] == "begin" else ""
            elif name == "reduce_issue":
                cell["reducing"] = True
            elif name in ("reduce_done", "reduce_complete"):
                cell["reducing"] = False
            message["cell"] = dict(cell)
        self.control.send(message)
        self.control.between_events()


_PARAMS = {"gather_issue": "gathering", "gather_done": "gathered", "reshard": "sharded"}


def _cell(unit) -> dict[str, Any]:
    """A unit's state between stages, as the mechanism view shows it."""
    from shardwise.core.unit import ShardedUnit

    return {"params": "sharded" if isinstance(unit, ShardedUnit) else "whole", "compute": "", "reducing": False}


def main() -> None:
    sink = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to stderr, which the server keeps for errors
    sys.stdout = sys.stderr
    control = Control(sys.stdin, sink)
    rank = int(os.environ["RANK"])
    try:
        machine = choose(int(os.environ["WORLD_SIZE"]))
        shardwise.init(backend=machine.backend, timeout=COLLECTIVE_TIMEOUT_S)
        run = None
        while True:
            cmd = control.commands.get()
            if cmd["cmd"] == "reset":
                run = Run(Settings.of(cmd["settings"]), int(cmd["seed"]), control, machine)
                run.ready()
            elif cmd["cmd"] == "stage" and run is not None:
                run.run_stage()
            elif cmd["cmd"] == "quit":
                break
    except Exception as exc:
        control.send({"type": "error", "rank": rank, "error": f"{type(exc).__name__}: {exc}"})
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # peers may wait in a collective: the server stops them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
