"""``shardwise bench --overhead``: what a unit costs, per phase, against FSDP2 and DDP.

    shardwise bench --overhead                       # N=1 and 2, 32..512 units, fp32
    shardwise bench --overhead --mixed-precision bf16 --strategy shard_grad_op

The model is ``n`` blocks of ``Linear(32, 32)`` + ``LayerNorm`` in an ``nn.Sequential``, so
small that a step is almost all per-unit host overhead and (at N > 1) collective latency. Each
system trains it with SGD on batches of 4 rows per rank: the plain module (no communication, on
every rank at once), DDP, FSDP2 (``fully_shard`` per block, then the root) and shardwise
(``wrap.by_class(Block)``). For each size every system is built from the same seed and warmed
up; then they take their timed steps in turn, a step each, so that a disturbance of a shared
machine falls on all of them alike, side by side in one run.

Phases come from the same clock hooks on every system, registered around the system's own (a
forward pre-hook prepended to the block's, one after its forward hooks, a tensor hook on its
output before the system's hooks and a pre-hook on the output's node after them (node pre-hooks
run after tensor hooks), one on the input of its first layer): pre-forward is the
block's pre-hooks up to its first layer, post-forward its last layer's end to its forward hooks'
end, pre-backward the hooks that run on its output's gradient, post-backward what runs between
its first layer's input gradient and the gradient of the block's own input (FSDP2's and
shardwise's identity functions on the inputs), optimizer ``step()`` + ``zero_grad()``. The
hooks cost the same in the plain module, so every figure is the system's minus the plain
module's, divided by the number of units. "step" is the whole step's, timed in a step of its
own with the clock off: the clock's tensor hooks do not cost every system alike (one goes on
the function FSDP2 and shardwise put on a unit's input, which the others lack). Figures are
rank 0's, medians over the timed steps. Results: a table on stdout, ``overhead.json``,
``overhead.md`` and ``overhead.png`` (step time against units; matplotlib, from the tools
extra) in ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..core import groups
from ..core.policies import STRATEGIES, Sharding

SYSTEMS = ("plain", "ddp", "fsdp2", "shardwise")
PHASES = ("pre_forward", "post_forward", "pre_backward", "post_backward", "optimizer")


@dataclass(frozen=True)
class OverheadConfig:
    units: tuple[int, ...] = (32, 64, 128, 256, 512)
    nprocs: tuple[int, ...] = (1, 2)
    strategy: str = "full_shard"
    mixed_precision: str = "none"  # or "bf16": shardwise's and FSDP2's policies, autocast elsewhere
    steps: int = 25
    warmup: int = 3
    batch_size: int = 4
    width: int = 32
    threads: int = 1
    out: str = "bench-overhead"


class Block(nn.Module):
    """One unit: a Linear and a LayerNorm."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


class PhaseClock:
    """Hooks around each block's (and the system's) hooks that sum seconds per phase."""

    def __init__(self, blocks: list[Block], clock: Callable[[], float] = time.perf_counter):
        self.now = clock
        self.enabled = True  # off: every hook returns at once (the step's own time)
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._mark = 0.0
        self._input: torch.Tensor | None = None
        self._post_backward_from: float | None = None
        for b in blocks:
            b.register_forward_pre_hook(self._pre, prepend=True)  # before the system's
            b.lin.register_forward_pre_hook(self._body_start)
            b.norm.register_forward_hook(self._body_end)
            b.register_forward_hook(self._post)  # after the system's

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def _pre(self, module, args) -> None:
        if not self.enabled:
            return
        self._input = args[0]
        if args[0].requires_grad:  # the first hook on a block's input gradient ends a post-backward
            args[0].register_hook(self._end_post_backward)
        self._mark = self.now()

    def _body_start(self, module, args) -> None:
        if not self.enabled:
            return
        self.seconds["pre_forward"] += self.now() - self._mark
        x = args[0]
        if x.requires_grad and x is not self._input:  # the system put a function on the input
            x.register_hook(self._start_post_backward)  # (before its node's pre-hooks)

    def _body_end(self, module, args, out) -> None:
        if not self.enabled:
            return
        if out.requires_grad:  # registered before the system's hooks on the output
            out.register_hook(self._start_pre_backward)
        self._mark = self.now()

    def _post(self, module, args, out) -> None:
        if not self.enabled:
            return
        self.seconds["post_forward"] += self.now() - self._mark
        if out.requires_grad:  # after the system's: its tensor hooks, and pre-hooks on the node
            if out.grad_fn is not None:
                out.grad_fn.register_prehook(self._end_pre_backward)
            else:
                out.register_hook(self._end_pre_backward)

    def _start_pre_backward(self, grad) -> None:
        self._end_post_backward(grad)
        self._mark = self.now()

    def _end_pre_backward(self, grad) -> None:  # (a gradient, or a node's tuple of them)
        self.seconds["pre_backward"] += self.now() - self._mark

    def _start_post_backward(self, grad) -> None:
        self._post_backward_from = self.now()

    def _end_post_backward(self, grad) -> None:
        if self._post_backward_from is not None:
            self.seconds["post_backward"] += self.now() - self._post_backward_from
            self._post_backward_from = None


def build(system: str, cfg: OverheadConfig, units: int, device: torch.device, mesh):
    """A fresh ``system`` of ``units`` blocks from the seed: the model, its SGD, its autocast."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .. import api
    from ..core import wrap

    torch.manual_seed(0)
    model = nn.Sequential(*(Block(cfg.width) for _ in range(units))).to(device)
    blocks = list(model)
    bf16 = cfg.mixed_precision == "bf16"
    strategy = Sharding(cfg.strategy)
    if system == "shardwise":
        api.shard(model, wrap=wrap.by_class(Block), strategy=strategy, mixed_precision="bf16" if bf16 else None)
    elif system == "fsdp2":
        mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()
        for b in blocks:
            fully_shard(b, mesh=mesh, reshard_after_forward=strategy.reshard_after_forward, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    elif system == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    clock = PhaseClock(blocks)
    cast = bf16 and system in ("plain", "ddp")
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if cast else contextlib.nullcontext
    return model, torch.optim.SGD(model.parameters(), lr=1e-2), clock, autocast


def compare(cfg: OverheadConfig, units: int, device: torch.device, mesh) -> dict[str, dict]:
    """Build every system of ``units`` blocks, warm each up, then take their timed steps in
    turn (a step of each, then the next): on a shared machine, a disturbance falls on all of
    them alike. Each timed step is taken twice, clock off for the step's time and clock on for
    its phases (the clock's hooks do not cost every system alike). Each system's medians
    (seconds)."""
    built = {s: build(s, cfg, units, device, mesh) for s in SYSTEMS}
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    rows = [torch.randn(cfg.batch_size * world, cfg.width, generator=g) for _ in range(cfg.warmup + cfg.steps)]
    samples = {s: {k: [] for k in ("step", *PHASES)} for s in SYSTEMS}
    for i, x in enumerate(rows):
        x = x[rank * cfg.batch_size : (rank + 1) * cfg.batch_size].to(device)
        for system, (model, opt, clock, autocast) in built.items():
            for timing_phases in (False, True):
                clock.enabled = timing_phases
                times = _step(model, opt, clock, autocast, x.clone().requires_grad_(True), device)
                if i >= cfg.warmup:
                    for k in PHASES if timing_phases else ("step",):
                        samples[system][k].append(times[k])
    del built
    gc.collect()
    return {s: {k: statistics.median(v) for k, v in kept.items()} for s, kept in samples.items()}


def _step(model, opt, clock: PhaseClock, autocast, x: torch.Tensor, device: torch.device) -> dict[str, float]:
    """One step; its seconds, whole and per phase."""
    clock.reset()
    t0 = time.perf_counter()
    with autocast():
        loss = model(x).float().square().mean()
    loss.backward()
    _sync(device)
    t1 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    _sync(device)
    t2 = time.perf_counter()
    return {"step": t2 - t0, "optimizer": t2 - t1, **{k: clock.seconds[k] for k in PHASES[:4]}}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # (the phases are host time, as the hooks see it)
        torch.cuda.synchronize()


def run_rank(cfg: OverheadConfig) -> dict:
    """Every size, every system in turn (collective); rank 0's medians."""
    from torch.distributed.device_mesh import init_device_mesh

    groups.init()
    torch.set_num_threads(cfg.threads)
    device = groups.device()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    compare(cfg, cfg.units[0], device, mesh)  # discarded: the process's first steps are slow
    results: dict[str, dict[str, dict]] = {}
    for n in cfg.units:
        results[str(n)] = compare(cfg, n, device, mesh)
        if dist.get_rank() == 0:
            line = ", ".join(f"{s} {1e3 * r['step']:.1f} ms" for s, r in results[str(n)].items())
            print(f"N={dist.get_world_size()} units={n}: {line}", file=sys.stderr, flush=True)
    return results


def per_unit(raw: dict) -> dict:
    """Each system's µs per unit, per phase and per step, over the plain module's."""
    out: dict[str, dict] = {}
    for n, systems in raw.items():
        plain = systems["plain"]
        out[n] = {
            s: {
                "step_ms": 1e3 * r["step"],
                **{k: 1e6 * (r[k] - plain[k]) / int(n) for k in ("step", *PHASES)},
            }
            for s, r in systems.items()
        }
    return out


def render_markdown(cfg: OverheadConfig, table: dict) -> str:
    head = "| N | units | system | step ms | µs/unit | " + " | ".join(PHASES) + " | x DDP |"
    lines = [head, "|" + "---:|" * (len(PHASES) + 6)]
    for world, sizes in table.items():
        for n, systems in sizes.items():
            ddp = systems["ddp"]["step_ms"]
            for s, r in systems.items():
                phases = " | ".join(f"{r[k]:.1f}" for k in PHASES)
                unit = "–" if s == "plain" else f"{r['step']:.1f}"
                lines.append(
                    f"| {world} | {n} | {s} | {r['step_ms']:.1f} | {unit} | {phases} | {r['step_ms'] / ddp:.2f} |"
                )
    setup = (
        f"strategy {cfg.strategy}, mixed precision {cfg.mixed_precision}, batch {cfg.batch_size} rows "
        f"per rank, SGD, median of {cfg.steps} steps; µs per unit over the plain module"
    )
    return setup + "\n\n" + "\n".join(lines) + "\n"


def plot(table: dict, path: Path) -> None:
    """Step time against units, log-log: a colour per system, a line style per N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = dict(zip(SYSTEMS, ("tab:gray", "tab:blue", "tab:orange", "tab:green")))
    styles = {"1": "--", "2": "-"}
    units: list[int] = []
    for world, sizes in table.items():
        units = [int(n) for n in sizes]
        for s in SYSTEMS:
            ax.plot(units, [sizes[str(n)][s]["step_ms"] for n in units], styles.get(world, ":"), marker="o",
                    color=colours[s], label=f"{s} N={world}")
    ax.set(xscale="log", yscale="log", xlabel="units (blocks of Linear(32, 32) + LayerNorm)", ylabel="step (ms)")
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(units, [str(n) for n in units])
    ax.legend(fontsize=8, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str]) -> OverheadConfig:
    d = OverheadConfig()
    p = argparse.ArgumentParser(prog="shardwise bench --overhead", description=__doc__.splitlines()[0])
    p.add_argument("--units", default=",".join(map(str, d.units)), help="comma-separated block counts")
    p.add_argument("--nprocs", default=",".join(map(str, d.nprocs)), help="comma-separated local rank counts")
    p.add_argument("--strategy", choices=[s for s in STRATEGIES if "hybrid" not in s], default=d.strategy)
    p.add_argument("--mixed-precision", choices=("none", "bf16"), default=d.mixed_precision)
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps per visit")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps per visit")
    p.add_argument("--threads", type=int, default=d.threads, help="intra-op threads per rank")
    p.add_argument("--out", default=d.out, help="output directory")
    a = p.parse_args(argv)
    return OverheadConfig(
        units=tuple(int(n) for n in a.units.split(",")),
        nprocs=tuple(int(n) for n in a.nprocs.split(",")),
        strategy=a.strategy,
        mixed_precision=a.mixed_precision,
        steps=a.steps,
        warmup=a.warmup,
        threads=a.threads,
        out=a.out,
    )


def report(cfg: OverheadConfig, table: dict) -> str:
    """Write overhead.json, overhead.md and (with matplotlib) overhead.png; return the table."""
    from ..observer import charts

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    md = render_markdown(cfg, table)
    (out / "overhead.json").write_text(json.dumps({"config": asdict(cfg), "per_unit": table}, indent=1))
    (out / "overhead.md").write_text(md)
    if charts.available():
        plot(table, out / "overhead.png")
    return md


def main(argv: list[str]) -> None:
    cfg = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(cfg.threads)  # read by torch as each rank starts
    table = {str(n): per_unit(groups.launch_local(n, run_rank, cfg)[0]) for n in cfg.nprocs}
    print(report(cfg, table))
