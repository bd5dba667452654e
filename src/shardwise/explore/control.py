"""The explorer's one run: the state every page sees, changed only by the pages' commands
and the ranks' messages.

Reset, Train, Pause and Step from any page act on the run and the result goes to every page
(two tabs see the same run). What the state holds about the run came from the ranks: their
units' states event by event, each stage's losses, memory and bytes, the model's prediction,
the planner's figures. The server itself only decides when to ask for the next stage.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

from .job import Job
from .settings import STAGES, STEPS_PER_STAGE, Settings

MAX_DELAY_MS = 2000  # the speed control's slowest: a pause after each event, in milliseconds

Broadcast = Callable[[dict], Awaitable[None]]


class Explorer:
    """The run behind the pages: its settings, its job of rank processes, and what the ranks
    have reported; ``state()`` is what a page draws."""

    def __init__(self, settings: Settings, broadcast: Broadcast):
        self.broadcast = broadcast
        self.settings = settings
        self.job: Job | None = None
        self.seed = 0
        self.delay_ms = 0
        self.training = False  # Train pressed: ask for stages until the run is complete
        self.paused = False
        self.in_stage = False  # a stage was asked for and not every rank has finished it
        self.status = "starting"
        self._reset_state()

    def _reset_state(self) -> None:
        n = self.settings.ranks
        self.stage = 0
        self.units: list[str] = []
        self.ranks: list[dict[str, Any]] = [
            {"rank": r, "pid": None, "alive": True, "error": "", "ready": False, "cells": [], "optimizer": False,
             "event": "", "measured": None} for r in range(n)
        ]
        self.loss: list[float] = []
        self.points: list = []
        self.grid: dict[str, Any] | None = None
        self.plan: dict[str, int] | None = None
        self.machine = ""  # where the ranks run, as rank 0 reports it
        self._stage_reports: dict[int, dict] = {}

    # --- what every page sees
    def state(self) -> dict[str, Any]:
        return {
            "type": "state", "status": self.status, "seed": self.seed, "settings": self.settings.as_dict(),
            "stage": self.stage, "stages": STAGES, "steps_per_stage": STEPS_PER_STAGE, "delay_ms": self.delay_ms,
            "paused": self.paused, "training": self.training, "units": self.units, "ranks": self.ranks,
            "loss": self.loss, "points": self.points, "grid": self.grid,
            "plan": self.plan, "machine": self.machine,
        }

    async def _publish(self) -> None:
        await self.broadcast(self.state())

    # --- commands from the pages
    async def command(self, cmd: dict[str, Any]) -> str | None:
        """Obey one command; a bad one returns the message to show (the run is untouched)."""
        name = cmd.get("cmd")
        if name == "reset":
            try:
                settings = Settings.of(cmd.get("settings") or self.settings.as_dict())
            except (TypeError, ValueError) as exc:
                return f"settings not applied: {exc}"
            await self.reset(settings)
        elif name in ("train", "step"):
            problem = self._cannot_run()
            if problem:
                return problem
            self.training = name == "train"
            await self._go()
        elif name == "pause":
            if self.job is not None and not self.paused:
                self.paused, self.training = True, False
                self.job.send({"cmd": "pause"})
                self.status = "paused"
        elif name == "speed":
            delay = cmd.get("delay_ms")
            if not isinstance(delay, int) or isinstance(delay, bool) or not 0 <= delay <= MAX_DELAY_MS:
                return f"speed: the delay must be a whole number of milliseconds from 0 to {MAX_DELAY_MS}, got {delay!r}"
            self.delay_ms = delay
            if self.job is not None:
                self.job.send({"cmd": "speed", "delay": delay / 1000})
        else:
            return f"unknown command {name!r}: use reset, train, step, pause or speed"
        await self._publish()
        return None

    def _cannot_run(self) -> str | None:
        """Why Train or Step cannot run a stage now, if they cannot."""
        if self.job is None or self.status == "dead":
            return "a rank is dead: Reset starts a new job"
        if self.status == "starting":
            return "the ranks are starting: Train and Step work once the status reads ready"
        if self.stage >= STAGES:
            return f"the run is complete ({STAGES} / {STAGES}): Reset starts a new one"
        return None

    async def _go(self) -> None:
        """Resume a paused run (it finishes the stage it is in), or start the next stage."""
        if self.paused:
            self.paused = False
            self.job.send({"cmd": "resume"})
        if not self.in_stage:
            self._next_stage()
        self.status = "running"

    def _next_stage(self) -> None:
        self.in_stage = True
        self._stage_reports = {}
        self.job.send({"cmd": "stage"})

    async def reset(self, settings: Settings) -> None:
        """A new seed and fresh model state on every rank: the same processes when they are
        alive, between stages and as many as asked for; otherwise (a rank dead, a stage under
        way, another number of ranks) a new job."""
        same = (
            self.job is not None and self.status != "dead" and not self.in_stage
            and settings.ranks == self.settings.ranks
        )
        self.settings, self.seed = settings, random.randrange(1, 1_000_000)
        self.training = self.paused = self.in_stage = False
        self.status = "starting"
        if not same:
            await self.stop()
            self.job = Job(settings.ranks, self._on_message, self._on_exit)
        self._reset_state()
        if not same:
            await self.job.start()
        for r, pid in zip(self.ranks, self.job.pids):
            r["pid"] = pid
        self.job.send({"cmd": "resume"})  # (paused between stages: the new run starts unpaused)
        self.job.send({"cmd": "speed", "delay": self.delay_ms / 1000})
        self.job.send({"cmd": "reset", "seed": self.seed, "settings": settings.as_dict()})

    async def stop(self) -> None:
        if self.job is not None:
            job, self.job = self.job, None
            await job.stop()

    # --- messages from the ranks
    def _on_message(self, rank: int, message: dict) -> None:
        kind = message["type"]
        if kind == "event":
            self._on_event(rank, message)
        elif kind == "ready":
            self._on_ready(rank, message)
        elif kind == "stage":
            self._on_stage(rank, message)
        elif kind == "error":
            self.ranks[rank]["error"] = message["error"]

    def _on_event(self, rank: int, message: dict) -> None:
        r = self.ranks[rank]
        if "cell" in message:
            r["cells"][message["unit"]] = message["cell"]
        if "cells" in message:
            r["cells"] = message["cells"]
        if "optimizer" in message:
            r["optimizer"] = message["optimizer"]
        unit = self.units[message["unit"]] if 0 <= message["unit"] < len(self.units) else ""
        r["event"] = f"stage {message['stage']} step {message['step']}: {message['name']} {unit}".strip()
        self._send(dict(message, event=r["event"]))

    def _on_ready(self, rank: int, message: dict) -> None:
        if message["seed"] != self.seed:  # a Reset pressed again before this one was ready
            return
        r = self.ranks[rank]
        r["ready"], r["cells"] = True, message["cells"]
        self.units = message["units"]
        if rank == 0:
            self.points, self.grid, self.plan = message["points"], message["grid"], message["plan"]
            self.machine = message["machine"]
        if all(x["ready"] for x in self.ranks):
            self.status = "ready"
            self._send(self.state())

    def _on_stage(self, rank: int, message: dict) -> None:
        r = self.ranks[rank]
        r["measured"] = {k: message[k] for k in ("held", "peak", "at_peak", "bytes_per_step", "theory_per_step")}
        r["optimizer"] = False
        r["event"] = f"stage {message['stage']} done"
        self._stage_reports[rank] = message
        if len(self._stage_reports) < len(self.ranks):
            return
        first = self._stage_reports[0]
        self.stage = first["stage"]
        self.loss += first["loss"]
        self.grid = dict(self.grid or {}, classes=first["classes"], confidence=first["confidence"], accuracy=first["accuracy"])
        self.in_stage = False
        if self.stage >= STAGES:
            self.training, self.status = False, "complete"
        elif self.training and not self.paused:
            self._next_stage()
        elif not self.paused:
            self.status = "ready"
        self._send(self.state())

    def _on_exit(self, rank: int, code: int, error: str) -> None:
        """A rank ended by itself: the run is dead; its peers would wait for it forever."""
        r = self.ranks[rank]
        r["alive"] = False
        r["error"] = f"exited with code {code}" + (f": {r['error'] or error}" if r["error"] or error else "")
        if self.status != "dead":
            self.status = "dead"
            self.training = self.in_stage = False
            asyncio.get_running_loop().create_task(self._bury())
        self._send(self.state())

    async def _bury(self) -> None:
        job = self.job
        if job is not None:
            await job.stop(grace=0.5)
            for r in self.ranks:
                if r["alive"] and not r["error"]:
                    r["alive"], r["error"] = False, "stopped: a peer died"
        await self._publish()

    def _send(self, message: dict) -> None:
        asyncio.get_running_loop().create_task(self.broadcast(message))
