"""The explorer's run state (control.py) without processes: a stand-in job records the
commands the ranks would get, and the ranks' messages are fed in as the ranks send them."""

from __future__ import annotations

import asyncio

import pytest

from shardwise.explore.control import Explorer
from shardwise.explore.settings import STAGES, STEPS_PER_STAGE, Settings


class FakeJob:
    def __init__(self, ranks: int):
        self.sent: list[dict] = []
        self.pids = list(range(100, 100 + ranks))

    def send(self, command: dict) -> None:
        self.sent.append(command)

    async def stop(self, grace: float = 3.0) -> None:
        self.sent.append({"cmd": "quit"})


def explorer(ranks: int = 2) -> tuple[Explorer, list[dict]]:
    pages: list[dict] = []

    async def broadcast(message: dict) -> None:
        pages.append(message)

    ex = Explorer(Settings(ranks=ranks), broadcast)
    ex.job, ex.seed = FakeJob(ranks), 7
    return ex, pages


def ready(ex: Explorer, seed: int = 7) -> None:
    for r in range(len(ex.ranks)):
        message = {"type": "ready", "rank": r, "seed": seed, "units": ["a", "<root>"], "cells": [{}, {}], "plan": {}}
        if r == 0:
            message.update(points=[[0.0, 0.0, 1]], grid={"classes": [1], "confidence": [0.5], "accuracy": 0.3}, machine="cpu (gloo)")
        ex._on_message(r, message)


def stage_done(ex: Explorer, k: int) -> None:
    for r in range(len(ex.ranks)):
        message = {
            "type": "stage", "rank": r, "stage": k, "loss": [1.0 / k] * STEPS_PER_STAGE, "held": {}, "peak": 1,
            "at_peak": {}, "bytes_per_step": 2, "theory_per_step": 2, "accuracy": 0.5,
        }
        if r == 0:
            message.update(classes=[2], confidence=[0.9])
        ex._on_message(r, message)


def test_train_asks_for_stages_until_the_run_is_complete():
    async def go():
        ex, pages = explorer()
        assert "starting" in await ex.command({"cmd": "train"})
        ready(ex, seed=3)  # a run a later Reset replaced: ignored
        assert ex.status == "starting"
        ready(ex)
        assert ex.status == "ready" and ex.points == [[0.0, 0.0, 1]] and ex.state()["machine"] == "cpu (gloo)"
        assert await ex.command({"cmd": "train"}) is None
        for k in range(1, STAGES + 1):
            assert ex.job.sent.count({"cmd": "stage"}) == k  # one at a time, after every rank's report
            stage_done(ex, k)
        assert ex.job.sent.count({"cmd": "stage"}) == STAGES
        assert ex.status == "complete" and ex.stage == STAGES and len(ex.loss) == STAGES * STEPS_PER_STAGE
        assert ex.grid["classes"] == [2]  # rank 0's model view
        assert "complete" in await ex.command({"cmd": "step"})
        await asyncio.sleep(0)
        assert pages[-1]["stage"] == STAGES

    asyncio.run(go())


def test_pause_holds_the_next_stage_and_step_runs_one():
    async def go():
        ex, _ = explorer()
        ready(ex)
        await ex.command({"cmd": "train"})
        await ex.command({"cmd": "pause"})
        assert ex.job.sent[-1] == {"cmd": "pause"} and ex.status == "paused"
        stage_done(ex, 1)  # the stage under way ends only after a resume, but none is asked for
        assert ex.job.sent.count({"cmd": "stage"}) == 1 and ex.status == "paused"
        await ex.command({"cmd": "step"})
        assert ex.job.sent[-2:] == [{"cmd": "resume"}, {"cmd": "stage"}]
        stage_done(ex, 2)
        assert ex.status == "ready" and ex.job.sent.count({"cmd": "stage"}) == 2

    asyncio.run(go())


def test_a_rank_that_raises_is_shown_dead_with_its_error():
    async def go():
        ex, _ = explorer()
        ready(ex)
        job = ex.job
        ex._on_message(1, {"type": "error", "rank": 1, "error": "RuntimeError: boom"})
        ex._on_exit(1, 1, "RuntimeError: boom")
        await asyncio.sleep(0.01)
        assert ex.status == "dead"
        assert ex.ranks[1]["error"] == "exited with code 1: RuntimeError: boom" and not ex.ranks[1]["alive"]
        assert ex.ranks[0]["error"] == "stopped: a peer died"
        assert job.sent[-1] == {"cmd": "quit"}  # the peers are stopped
        assert "dead" in await ex.command({"cmd": "train"})

    asyncio.run(go())


@pytest.mark.parametrize(
    ("cmd", "problem"),
    [
        ({"cmd": "speed", "delay_ms": 2001}, "from 0 to 2000, got 2001"),
        ({"cmd": "speed", "delay_ms": "fast"}, "got 'fast'"),
        ({"cmd": "reset", "settings": {"ranks": 7}}, "settings not applied: ranks must be"),
        ({"cmd": "reset", "settings": {"strategy": "ddp"}}, "strategy must be one of"),
        ({"cmd": "jump"}, "unknown command 'jump'"),
    ],
)
def test_bad_commands_leave_the_run_alone(cmd, problem):
    async def go():
        ex, _ = explorer()
        ready(ex)
        sent = list(ex.job.sent)
        assert problem in await ex.command(cmd)
        assert ex.job.sent == sent and ex.status == "ready" and ex.seed == 7

    asyncio.run(go())
