"""``shardwise bench --overhead``: the phase clock charges each phase what runs in it (on a clock the test moves), and the
benchmark runs every system at every size and writes its table (no timing is asserted)."""

import json

import torch
from torch import nn

from shardwise.bench import overhead


class Clock:
    """A clock that only the simulated system's hooks move."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


# what each simulated hook adds to the clock: a different power of ten per phase
PRE_FORWARD, POST_FORWARD, PRE_BACKWARD, POST_BACKWARD = 1.0, 10.0, 100.0, 1000.0


def _slow_system(block: nn.Module, clock: Clock) -> None:
    """Hooks where FSDP2's and shardwise's are, each taking a known time: pre-forward
    (prepended; marks the input with an identity whose backward is the post-backward) and
    post-forward (registers a pre-backward hook on the output)."""

    class Marked(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            clock.t += POST_BACKWARD
            return g

    def pre(module, args):
        clock.t += PRE_FORWARD
        return (Marked.apply(args[0]),)

    def post(module, args, out):
        clock.t += POST_FORWARD

        def pre_backward(g):
            clock.t += PRE_BACKWARD

        out.register_hook(pre_backward)

    block.register_forward_pre_hook(pre, prepend=True)
    block.register_forward_hook(post)


def _run(blocks) -> None:
    y = torch.randn(2, 8, requires_grad=True)
    for b in blocks:
        y = b(y)
    y.sum().backward()


def _clocked_slow_system() -> tuple[list[nn.Module], overhead.PhaseClock]:
    """Three blocks under ``_slow_system``'s hooks, with a phase clock on the same fake time."""
    clock = Clock()
    blocks = [overhead.Block(8) for _ in range(3)]
    for b in blocks:
        _slow_system(b, clock)
    return blocks, overhead.PhaseClock(blocks, clock)


def test_phase_clock_charges_each_phase_its_hooks():
    blocks, phases = _clocked_slow_system()
    _run(blocks)
    # each block's hook is charged to its own phase, and nothing of another phase's
    assert phases.seconds == {
        "pre_forward": 3 * PRE_FORWARD, "post_forward": 3 * POST_FORWARD,
        "pre_backward": 3 * PRE_BACKWARD, "post_backward": 3 * POST_BACKWARD, "optimizer": 0.0,
    }


def test_phase_clock_charges_nothing_to_a_plain_module():
    blocks = [overhead.Block(8) for _ in range(3)]
    phases = overhead.PhaseClock(blocks)
    _run(blocks)
    assert all(s < 0.1 for s in phases.seconds.values()), phases.seconds
    assert phases.seconds["post_backward"] == 0.0  # no function on the inputs: never started


def test_phase_clock_off_neither_charges_nor_hooks_tensors(monkeypatch):
    blocks, phases = _clocked_slow_system()
    phases.enabled = False  # the step's own time: no hook on any tensor or node
    registered = []
    real = torch.Tensor.register_hook
    monkeypatch.setattr(torch.Tensor, "register_hook", lambda t, h: registered.append(h) or real(t, h))
    _run(blocks)
    assert all(s == 0.0 for s in phases.seconds.values()), phases.seconds
    assert not [h for h in registered if getattr(h, "__self__", None) is phases]


def test_overhead_bench_runs_every_system(pools, tmp_path):
    cfg = overhead.OverheadConfig(units=(2, 4), steps=2, warmup=1, out=str(tmp_path))
    raw = pools(2).run(overhead.run_rank, cfg)[0]
    table = {"2": overhead.per_unit(raw)}
    md = overhead.report(cfg, table)
    assert list(table["2"]) == ["2", "4"]
    for n, systems in table["2"].items():
        assert list(systems) == list(overhead.SYSTEMS)
        assert all(r["step_ms"] > 0 for r in systems.values())
        assert all(f"| 2 | {n} | {s} |" in md for s in overhead.SYSTEMS)
    saved = json.loads((tmp_path / "overhead.json").read_text())
    assert saved["per_unit"] == table and saved["config"]["units"] == [2, 4]
    png = (tmp_path / "overhead.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")


def test_overhead_arguments():
    cfg = overhead.parse_args(["--units", "8,16", "--nprocs", "1", "--mixed-precision", "bf16"])
    assert cfg.units == (8, 16) and cfg.nprocs == (1,) and cfg.mixed_precision == "bf16"
