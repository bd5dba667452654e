"""The explorer's rank job and its settings, without a server: the sharded run it drives
trains exactly as one process trains the whole model, and the tracer streams every event it
records."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwise.explore import task
from shardwise.explore.settings import STEPS_PER_STAGE, Settings


class Sink:
    """Stands in for the server's pipe: keeps what the rank sends; never pauses."""

    def __init__(self):
        self.messages: list[dict] = []

    def send(self, message: dict) -> None:
        self.messages.append(message)

    def between_events(self) -> None:
        pass


def explorer_stages(strategy: str, seed: int, stages: int):
    import shardwise
    from shardwise.explore.machine import CPU
    from shardwise.explore.rank import Run

    sink = Sink()
    run = Run(Settings(ranks=dist.get_world_size(), strategy=strategy), seed, sink, CPU)
    for _ in range(stages):
        run.run_stage()
    state = {k: v.clone() for k, v in shardwise.full_state_dict(run.model).items()}
    return sink.messages, state


def reference(seed: int, steps: int):
    """One process, the unsharded model, the whole batch: the same optimizer and data."""
    from shardwise.explore.rank import LR

    torch.manual_seed(seed)
    model = task.Net()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    xy, label = task.points(seed)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(xy), label)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        accuracy = (model(xy).argmax(-1) == label).float().mean().item()
    return losses, model.state_dict(), accuracy


@pytest.mark.parametrize(("strategy", "ranks"), [("full_shard", 2), ("no_shard", 2), ("hybrid_shard", 4)])
def test_run_matches_one_process(pools, strategy, ranks):
    stages, seed = 1, 11
    (messages, state), (messages1, _), *_ = pools(ranks).run(explorer_stages, strategy, seed, stages)
    ref_losses, ref_state, ref_accuracy = reference(seed, stages * STEPS_PER_STAGE)
    reports = [m for m in messages if m["type"] == "stage"]
    assert [m["stage"] for m in reports] == [1]
    losses = [v for m in reports for v in m["loss"]]
    # the global batch's loss, step by step: rounded to 5 decimals when sent
    assert losses == pytest.approx(ref_losses, abs=2e-5)
    assert losses[-1] < losses[0] * 0.8  # it learns
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, atol=2e-5, rtol=1e-4, msg=name)
    assert reports[-1]["accuracy"] == pytest.approx(ref_accuracy, abs=1 / task.POINTS)
    # the model view: every grid point gets a class from the sharded model's forward
    assert len(reports[-1]["classes"]) == task.GRID**2 and set(reports[-1]["classes"]) <= set(range(task.CLASSES))
    assert "classes" not in next(m for m in messages1 if m["type"] == "stage")  # rank 0 sends it
    # memory against DDP: full_shard holds half of each kind on 2 ranks (padding aside)
    held = reports[-1]["held"]
    if strategy != "no_shard":  # full_shard over 2 ranks, or hybrid: shard groups of 2 (x 2 replicas)
        assert held["params"] == pytest.approx(held["ddp_params"] / 2, rel=0.02)
        assert held["optimizer"] == pytest.approx(held["ddp_optimizer"] / 2, rel=0.02)
    else:
        assert held["params"] == held["ddp_params"]
    # bytes sent per step: measured by the collectives, against the formula
    assert reports[-1]["bytes_per_step"] == pytest.approx(reports[-1]["theory_per_step"], rel=0.02)


def test_events_stream_as_the_mechanism_changes(pools):
    messages, _ = pools(2).run(explorer_stages, "full_shard", 3, 1)[0]
    events = [m for m in messages if m["type"] == "event"]
    # per step: every unit gathered and resharded, forward and backward, the optimizer
    assert {m["step"] for m in events} == set(range(1, STEPS_PER_STAGE + 1))
    seen = {m["cell"]["params"] for m in events if "cell" in m}
    assert {"gathering", "gathered", "sharded"} <= seen
    assert {m["cell"]["compute"] for m in events if "cell" in m} >= {"forward", "backward", ""}
    assert any(m["cell"]["reducing"] for m in events if "cell" in m)
    assert sum(1 for m in events if m.get("optimizer") is True) == STEPS_PER_STAGE
    # at each step's end every unit is sharded again, computing nothing
    ends = [m for m in events if m["name"] == "step_end"]
    assert len(ends) == STEPS_PER_STAGE
    assert all(c == {"params": "sharded", "compute": "", "reducing": False} for c in ends[-1]["cells"])


def streamed_and_recorded():
    import shardwise
    from shardwise.observer.trace import trace

    torch.manual_seed(0)
    model = task.Net()
    shardwise.shard(model, wrap=shardwise.wrap.by_class(task.Block))
    opt = torch.optim.Adam(model.parameters())
    got: list[list] = []
    xy, label = task.points(0)
    with trace(model, opt, on_event=got.append) as t:
        torch.nn.functional.cross_entropy(model(xy), label).backward()
        opt.step()
        opt.zero_grad()
    return got, t.data["ranks"][dist.get_rank()]["events"]


def test_trace_streams_every_recorded_event(pools):
    for got, recorded in pools(2).run(streamed_and_recorded):
        assert got == recorded and len(got) > 20


@pytest.mark.parametrize(
    ("given", "problem"),
    [
        ({"ranks": 0}, "ranks must be a whole number from 1 to 4, got 0"),
        ({"ranks": 5}, "ranks must be a whole number from 1 to 4, got 5"),
        ({"ranks": "2"}, "ranks must be a whole number"),
        ({"strategy": "zero9"}, "strategy must be one of full_shard, shard_grad_op, no_shard, hybrid_shard, hybrid_shard_grad_op; got 'zero9'"),
        ({"strategy": "hybrid_shard"}, "it needs ranks = 4 (2 replicas x 2 shards), got ranks = 2"),
        ({"strategy": "hybrid_shard_grad_op", "ranks": 3}, "it needs ranks = 4 (2 replicas x 2 shards), got ranks = 3"),
        ({"comm": "fp4"}, "comm must be one of"),
        ({"cpu_offload": "yes"}, "cpu_offload must be true or false"),
        ({"strategy": "no_shard", "cpu_offload": True}, "cpu_offload needs a sharded strategy"),
        ({"colour": "red"}, "unknown setting(s) ['colour']"),
    ],
)
def test_bad_settings_name_the_problem(given, problem):
    with pytest.raises(ValueError) as info:
        Settings.of(given)
    assert problem in str(info.value)


def test_points_come_from_the_seed():
    a, la = task.points(5)
    b, lb = task.points(5)
    c, _ = task.points(6)
    assert torch.equal(a, b) and torch.equal(la, lb) and not torch.allclose(a, c)
    assert a.shape == (task.POINTS, 2) and la.bincount().tolist() == [task.POINTS // task.CLASSES] * task.CLASSES


@pytest.mark.parametrize(
    ("available", "gpus", "ranks", "chosen"),
    [
        (True, 4, 4, ("cuda", "nccl")),
        (True, 2, 2, ("cuda", "nccl")),
        (True, 2, 3, ("cpu", "gloo")),  # fewer GPUs than ranks: all on the CPU, never shared GPUs
        (False, 0, 1, ("cpu", "gloo")),
    ],
)
def test_the_machine_follows_the_gpus(monkeypatch, available, gpus, ranks, chosen):
    from shardwise.explore import machine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    m = machine.choose(ranks)
    assert (m.device, m.backend) == chosen
