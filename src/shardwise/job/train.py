"""The main job: train the built-in GPT on the offline corpus with shardwise, and show what
every rank held and sent.

    shardwise train                       # 2 local ranks on CPU (Gloo), one per GPU on CUDA (NCCL)
    torchrun --nproc_per_node 4 -m shardwise train --strategy shard_grad_op
    shardwise train --nproc 4 --strategy hybrid_shard --shard-size 2   # 2 replicas x 2 shards
    shardwise train --save-every 100 --resume   # checkpoints in ./checkpoints; rerun to continue

Many nodes (README.md): torchrun on each node with ``--strategy hybrid_shard``, the node as
shard group; ``--global-batch-size`` keeps the data the same when a lost node's job restarts
at another world size and resumes.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import math
import os
import socket
import sys
import time
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from .. import api, checkpoint
from ..core import collectives as C
from ..core import groups
from ..core.collectives import comm_stats, reset_comm_stats
from ..core.policies import STRATEGIES, WIRE_FORMATS, Comm, Settings, Sharding
from ..core.recompute import checkpoint_activations
from ..core.runtime import runtime_of
from ..core.scaler import GradScaler
from ..core.wrap import by_class, by_size
from ..observer import charts, report
from ..observer.accounting import dtype_table, held_bytes, kept_buckets, theory_bytes_per_step
from ..observer.trace import trace
from ..planner.plan import plan
from .data import get_batch, rank_slice
from .models import GPT, Block, gpt_config


@dataclass
class TrainConfig:
    """Options of ``shardwise train`` (each doubles as the CLI help)."""

    nproc: int = 0  # ranks to launch on this machine (0: one per GPU, else 2)
    strategy: str = "full_shard"  # full_shard | shard_grad_op | no_shard | hybrid_shard | hybrid_shard_grad_op
    shard_size: int = 0  # hybrid: ranks per shard group (0: torchrun's LOCAL_WORLD_SIZE, one node)
    wrap: str = "block"  # block (one unit per transformer block) | size | none (root only)
    steps: int = 200  # optimizer steps
    batch_size: int = 4  # sequences per rank per step
    global_batch_size: int = 0  # sequences per step over all ranks (0: batch_size x ranks)
    model_size: str = "small"  # tiny | small | medium | large
    seq_len: int = 64  # tokens per sequence
    lr: float = 2e-3  # peak learning rate (AdamW, warm-up then cosine decay)
    seed: int = 0
    log_every: int = 10  # steps between progress updates
    mixed_precision: str = "none"  # none | bf16 | fp16 (fp16 uses shardwise.GradScaler)
    comm: str = "exact"  # precision on the wire: exact | bf16 | fp8 | int8 (every gather and reduction)
    error_feedback: bool = False  # keep what encoding the gradients drops, for the next step
    cpu_offload: bool = False  # shards, gradients and optimizer state in host memory
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    # device memory per rank, e.g. 120MiB: shardwise.plan chooses the strategy and, per block,
    # resharding, recomputation and offload (instead of the three options above)
    memory_budget: str = ""
    compile: bool = False  # torch.compile each transformer block after shard() (inductor)
    save_every: int = 0  # optimizer steps between checkpoints (0: none)
    checkpoint_dir: str = "checkpoints"  # where checkpoints are written and --resume looks
    resume: bool = False  # continue from the newest complete checkpoint in checkpoint_dir
    report: str = ""  # trace the last steps and write this HTML report (with its traces beside it)
    loss_curve: str = ""  # draw the loss at each logged step into this PNG (needs matplotlib)
    # this job is one replica group of a fault-tolerant run on torchft (shardwise.ft): the
    # lighthouse (default $TORCHFT_LIGHTHOUSE) and the group's name (default: the host's)
    fault_tolerance: bool = False
    lighthouse: str = ""
    replica_id: str = ""


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    p = argparse.ArgumentParser(prog="shardwise train", description=__doc__.splitlines()[0])
    defaults = TrainConfig()
    p.add_argument("--nproc", type=int, default=defaults.nproc, help="ranks on this machine (0: one per GPU, else 2)")
    p.add_argument("--strategy", choices=STRATEGIES, default=defaults.strategy)
    p.add_argument("--shard-size", type=int, default=defaults.shard_size,
                   help="hybrid strategies: ranks per shard group (default: the ranks of one node)")
    p.add_argument("--wrap", choices=("block", "size", "none"), default=defaults.wrap, help="which modules become units")
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences per rank per step")
    p.add_argument("--global-batch-size", type=int, default=defaults.global_batch_size,
                   help="sequences per step over all ranks, split among them (instead of --batch-size): "
                   "the same data at any world size, e.g. after a lost node")
    p.add_argument("--model-size", choices=("tiny", "small", "medium", "large"), default=defaults.model_size)
    p.add_argument("--seq-len", type=int, default=defaults.seq_len)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--log-every", type=int, default=defaults.log_every)
    p.add_argument("--mixed-precision", choices=("none", "bf16", "fp16"), default=defaults.mixed_precision)
    p.add_argument("--comm", choices=("exact", *WIRE_FORMATS), default=defaults.comm,
                   help="precision on the wire for every gather and reduction (shardwise.Comm)")
    p.add_argument("--error-feedback", action="store_true",
                   help="with --comm: carry what encoding the gradients drops into the next step")
    p.add_argument("--cpu-offload", action="store_true", help="shards, grads and optimizer state in host memory")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute block activations in backward")
    p.add_argument("--memory-budget", default=defaults.memory_budget,
                   help="device memory per rank, e.g. 120MiB: the planner chooses the strategy and, per "
                   "block, resharding, activation checkpointing and offload")
    p.add_argument("--compile", action="store_true", help="torch.compile each transformer block (after shard)")
    p.add_argument("--save-every", type=int, default=defaults.save_every, help="steps between checkpoints (0: none)")
    p.add_argument("--checkpoint-dir", default=defaults.checkpoint_dir, help="where checkpoints go and --resume looks")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint, if any")
    p.add_argument("--report", nargs="?", const="report.html", default=defaults.report,
                   help="trace the last 3 steps; write this HTML report (default report.html)")
    p.add_argument("--loss-curve", nargs="?", const="loss.png", default=defaults.loss_curve,
                   help="draw the loss curve into this PNG (default loss.png; needs matplotlib)")
    p.add_argument("--fault-tolerance", action="store_true",
                   help="this job is one replica group on torchft: a lost group is dropped while the others go "
                   "on, and heals from them when it comes back (pip install 'shardwise[ft]')")
    p.add_argument("--lighthouse", default=defaults.lighthouse, help="torchft's lighthouse (default $TORCHFT_LIGHTHOUSE)")
    p.add_argument("--replica-id", default=defaults.replica_id, help="this group's name (default: the host name)")
    a = p.parse_args(argv)
    if a.loss_curve and not charts.available():
        p.error(f"--loss-curve needs matplotlib: {charts.INSTALL}")
    if a.memory_budget and (a.cpu_offload or a.activation_checkpointing or a.strategy != defaults.strategy):
        p.error("--memory-budget chooses the strategy, checkpointing and offload: drop --strategy, "
                "--cpu-offload and --activation-checkpointing")
    if a.shard_size and not Sharding.of(a.strategy).hybrid:
        p.error(f"--shard-size is for --strategy hybrid_shard or hybrid_shard_grad_op, not {a.strategy}")
    return TrainConfig(**{k.replace("-", "_"): v for k, v in vars(a).items()})


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    if "RANK" in os.environ:  # already launched by torchrun
        worker(cfg)
        return
    nproc = cfg.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    groups.launch_local(nproc, worker, cfg)


def _planned(cfg: TrainConfig, build, wrap, world: int, global_batch: int) -> Settings:
    """--memory-budget: the plan every rank applies (rank 0 plans; plan() is collective),
    printed on rank 0."""
    chosen = plan(
        build, world_size=world, wrap=wrap, batch_size=global_batch // world, seq_len=cfg.seq_len,
        mixed_precision=None if cfg.mixed_precision == "none" else cfg.mixed_precision,
        budget=cfg.memory_budget,
    )
    if dist.get_rank() == 0:
        print(chosen, flush=True)
    return chosen.settings


def _lr_at(step: int, cfg: TrainConfig) -> float:
    warm = max(1, cfg.steps // 20)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def worker(cfg: TrainConfig) -> dict:
    """One rank of the job: build on the meta device, shard, train, report."""
    groups.init()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    run = Run(cfg)
    if run.start >= cfg.steps:
        if run.rank == 0:
            print(f"already trained {run.start} steps (--steps {cfg.steps}): nothing to do", flush=True)
        return {}
    if run.rank == 0:
        dtype_table(run.model)
    run.train()
    run.write_outputs()
    summary = run.summary()
    if run.rank == 0:
        print(render_summary(summary), flush=True)
    C.blocking("barrier", "end of training", dist.barrier)
    if run.ft is not None:
        run.ft.shutdown()
    return summary


class Run:
    """One rank's training run: the sharded model, its optimizer (and loss scaler), the data
    stream, and what the run measures on the way (losses, step times, memory, bytes sent).

    ``step`` is one optimizer step; ``train`` loops over the steps, logging, saving and tracing
    around them; ``summary`` gathers every rank's figures."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.global_batch = _global_batch(cfg, self.world)
        self.device = groups.device()
        mcfg = gpt_config(cfg.model_size, seq_len=cfg.seq_len)
        wrap = {"block": by_class(Block), "size": by_size(1_000_000), "none": None}[cfg.wrap]
        chosen = (
            _planned(cfg, functools.partial(GPT, mcfg), wrap, self.world, self.global_batch)
            if cfg.memory_budget
            else None
        )
        torch.manual_seed(cfg.seed)
        with torch.device("meta"):
            self.model = model = GPT(mcfg)
        self.ft = _replica_groups(cfg) if cfg.fault_tolerance else None
        _shard(cfg, model, wrap, chosen, self.ft)
        if cfg.activation_checkpointing:
            checkpoint_activations(model, by_class(Block))
        self.sharding = runtime_of(model).sharding
        offloaded = any(getattr(u, "offloaded", False) for u in api.units(model))
        if cfg.compile:  # after shard(): the hooks stay outside the compiled graphs
            for m in model.modules():
                if isinstance(m, Block):
                    m.compile()
        self.scaler = GradScaler(model) if cfg.mixed_precision == "fp16" else None
        # offloaded shards step on the CPU: the fused CPU kernel of AdamW does it in one pass
        self.opt = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1,
            **({"fused": True} if offloaded else {}),
        )
        # what steps the optimizer: it, or under fault tolerance it once the step commits
        self.stepper = self.ft.optimizer(self.opt) if self.ft else self.opt
        # each replica group reads its own data
        self.seed = cfg.seed + (zlib.crc32(self.ft.replica_id.encode()) if self.ft else 0)
        self.start = _resume(cfg, model, self.opt, self.scaler, self.global_batch, self.ft) if cfg.resume else 0
        # what the run measures
        self.curve: tuple[list[int], list[float]] = ([], [])  # the logged steps and their losses
        self.step_times: list[float] = []
        self.first_loss, self.loss = None, float("nan")
        self.warmup = self.start + min(5, (cfg.steps - self.start) // 4)  # steps before measuring
        self.peak: dict[str, dict[str, int]] = {}
        self.held: dict[str, int] = {}
        self.tracer = None

    def step(self, step: int) -> torch.Tensor:
        """One optimizer step on this rank's slice of the step's global batch; the loss."""
        cfg, model, opt, scaler = self.cfg, self.model, self.opt, self.scaler
        x, y = get_batch(step, self.global_batch, cfg.seq_len, seed=self.seed)
        x, y = rank_slice(x, self.rank, self.world).to(self.device), rank_slice(y, self.rank, self.world).to(self.device)
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg)
        tracker = _memory_tracker(model, opt) if step == max(self.start, cfg.steps - 2) else None
        with tracker or contextlib.nullcontext(), warnings.catch_warnings():
            warnings.simplefilter("ignore" if tracker else "default")
            out = model(x, y)
            (scaler.scale(out) if scaler else out).backward()
            if scaler:
                scaler.unscale_(opt)
            api.clip_grad_norm_(model, 1.0)
            scaler.step(self.stepper) if scaler else self.stepper.step()
            if scaler:
                scaler.update()
        if tracker is not None:
            self.peak = _peak_by_category(tracker)
        if step == cfg.steps - 1:
            self.held = held_bytes(model, opt)  # with this step's gradients still present
        self.stepper.zero_grad(set_to_none=True)  # (under fault tolerance: joins the next step's quorum)
        return out

    def _steps(self) -> Iterator[int]:
        """The steps to take; under fault tolerance the committed step from the quorum, again
        where a step did not commit."""
        if self.ft is None:
            yield from range(self.start, self.cfg.steps)
            return
        self.stepper.zero_grad(set_to_none=True)  # joins the first quorum (and heals)
        while self.ft.step < self.cfg.steps:
            yield self.ft.step

    def train(self) -> None:
        """Every step from ``start``: timed, logged, checkpointed every ``save_every``, and the
        last three traced with ``--report``."""
        cfg = self.cfg
        bar = Progress(cfg.steps, self.start, enabled=self.rank == 0)
        saving = None
        tracing = contextlib.ExitStack()  # --report: the last steps run traced
        for step in self._steps():
            if step == self.warmup:
                reset_comm_stats()
            if cfg.report and step == max(self.start, cfg.steps - 3):
                self.tracer = tracing.enter_context(trace(self.model, self.opt))
            t0 = time.perf_counter()
            out = self.step(step)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.step_times.append(time.perf_counter() - t0)
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                self._log(step, out, bar)
            committed = self.ft is None or self.ft.step > step
            if cfg.save_every and (step + 1) % cfg.save_every == 0 and committed:
                # written in the background while training goes on; the next save waits for it
                saving = checkpoint.save(
                    os.path.join(_checkpoint_dir(cfg, self.ft), f"step-{step + 1:08d}"), self.model, self.opt,
                    step=step + 1, extra=_resume_state(cfg, self.global_batch, self.scaler, self.ft), async_=True,
                )
        if saving is not None:
            saving.wait()
        bar.close()
        tracing.close()  # collective: every rank leaves the trace here

    def _log(self, step: int, out: torch.Tensor, bar: Progress) -> None:
        """The loss averaged over the ranks, on the progress bar and the loss curve."""
        t = out.detach().clone()
        C.blocking("all_reduce", "logged loss", dist.all_reduce, t)
        self.loss = t.item() / self.world
        self.first_loss = self.loss if self.first_loss is None else self.first_loss
        recent = self.step_times[-self.cfg.log_every :]
        bar.update(step + 1, self.loss, self.global_batch * self.cfg.seq_len / (sum(recent) / len(recent)))
        self.curve[0].append(step + 1)
        self.curve[1].append(self.loss)

    def write_outputs(self) -> None:
        """Rank 0: the loss curve (--loss-curve) and the report of the traced steps (--report)."""
        cfg = self.cfg
        if cfg.loss_curve and self.rank == 0:
            title = f"{cfg.model_size} GPT, {self.sharding}, {self.world} ranks"
            charts.loss_curve(*self.curve, Path(cfg.loss_curve), title)
            print(f"wrote the loss curve to {cfg.loss_curve}", flush=True)
        if cfg.report and self.rank == 0:
            self.tracer.save(Path(cfg.report).with_suffix(".trace.json"))
            self.tracer.save_chrome(Path(cfg.report).with_suffix(".chrome.json"))
            print(f"report: {report.write(self.tracer.data, cfg.report)} (traces beside it)", flush=True)

    def summary(self) -> dict:
        """The run's figures, every rank's row included (collective)."""
        cfg = self.cfg
        measured = max(1, cfg.steps - self.warmup)
        per_step = {k: v.bytes // measured for k, v in comm_stats().items()}
        timed = self.step_times[self.warmup - self.start :] or self.step_times
        row = {
            "rank": self.rank,
            **self.held,
            "all_gather": per_step["all_gather"],
            "reduce_scatter": per_step["reduce_scatter"],
            "all_reduce": per_step["all_reduce"],
            "replicate_all_reduce": per_step["replicate_all_reduce"],
            "replica_groups_all_reduce": per_step["replica_groups_all_reduce"],
            "peak": self.peak,
            "step_ms": 1000 * sorted(timed)[len(timed) // 2],
        }
        rows = [None] * self.world
        C.blocking("all_gather", "summary", dist.all_gather_object, rows, row)
        tokens_per_step = self.global_batch * cfg.seq_len
        return {
            "config": asdict(cfg),
            "strategy": self.sharding.value,  # the plan's, with --memory-budget
            "world_size": self.world,
            "device": str(self.device),
            "first_loss": self.first_loss,
            "final_loss": self.loss,
            "curve": self.curve,
            "rows": rows,
            "theory": theory_bytes_per_step(self.model, self.sharding),
            "tokens_per_s": tokens_per_step / (sum(self.step_times[self.warmup - self.start :]) / measured),
        }


def _shard(cfg: TrainConfig, model: torch.nn.Module, wrap, chosen: Settings | None, ft) -> None:
    """``shard()`` as the options say: the plan's settings with --memory-budget."""
    wire = replace(Comm.of(cfg.comm), error_feedback=cfg.error_feedback)
    if chosen is not None:
        api.shard(model, plan=chosen, mixed_precision=cfg.mixed_precision, comm=wire, fault_tolerance=ft)
    else:
        api.shard(
            model,
            wrap=wrap,
            strategy=cfg.strategy,
            shard_size=cfg.shard_size or None,
            mixed_precision=cfg.mixed_precision,
            cpu_offload=cfg.cpu_offload,
            comm=wire,
            fault_tolerance=ft,
        )


def _replica_groups(cfg: TrainConfig):
    """--fault-tolerance: this job as one replica group on the lighthouse (shardwise.ft)."""
    import shardwise.ft  # the [ft] extra, imported only here

    lighthouse = cfg.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
    if not lighthouse:
        raise SystemExit("--fault-tolerance needs torchft's lighthouse: --lighthouse http://HOST:PORT or $TORCHFT_LIGHTHOUSE")
    return shardwise.ft.Torchft(lighthouse=lighthouse, replica_id=cfg.replica_id or socket.gethostname())


def _checkpoint_dir(cfg: TrainConfig, ft) -> str:
    """Where this job's checkpoints go: with fault tolerance each group keeps its own."""
    return os.path.join(cfg.checkpoint_dir, ft.replica_id) if ft else cfg.checkpoint_dir


def _global_batch(cfg: TrainConfig, world: int) -> int:
    """Sequences per step over all ranks: --global-batch-size, split evenly, or --batch-size
    on every rank."""
    if not cfg.global_batch_size:
        return cfg.batch_size * world
    if cfg.global_batch_size % world:
        raise SystemExit(
            f"--global-batch-size {cfg.global_batch_size} does not split evenly among {world} ranks: "
            "use a multiple of the world size"
        )
    return cfg.global_batch_size


def _resume_state(cfg: TrainConfig, global_batch: int, scaler: GradScaler | None, ft=None) -> dict:
    """What a checkpoint needs besides tensors: the data stream's definition (a batch is a
    pure function of step, seed, global batch and sequence length), the loss scaler and,
    under fault tolerance, the committed step count."""
    return {
        "data": {"seed": cfg.seed, "global_batch": global_batch, "seq_len": cfg.seq_len},
        "model_size": cfg.model_size,
        "scaler": scaler.state_dict() if scaler else None,
        "ft": ft.state_dict() if ft else None,
    }


def _resume(cfg: TrainConfig, model, opt, scaler: GradScaler | None, global_batch: int, ft=None) -> int:
    """Load the newest complete checkpoint in this job's checkpoint directory (model,
    optimizer, each rank's RNG, the loss scaler, the committed step count); return the step
    to continue from (0 when there is none)."""
    where = _checkpoint_dir(cfg, ft)
    path = checkpoint.latest(where)
    if path is None:
        if dist.get_rank() == 0:
            print(f"--resume: no complete checkpoint in {where}; starting at step 0", flush=True)
        return 0
    info = checkpoint.load(path, model, opt)
    saved, now = info.extra, _resume_state(cfg, global_batch, scaler)
    if saved["data"] != now["data"]:
        raise SystemExit(
            f"--resume: {path} was trained on data {saved['data']}, this run would read {now['data']}; "
            "keep --seed and --seq-len, and set --batch-size so that batch size x ranks is the same "
            "(or --global-batch-size)"
        )
    if scaler is not None and saved["scaler"] is not None:
        scaler.load_state_dict(saved["scaler"])
    if ft is not None and saved.get("ft"):
        ft.load_state_dict(saved["ft"])
    if dist.get_rank() == 0:
        rng = "restored" if info.rng_restored else f"not restored (saved at {info.world_size} ranks)"
        print(f"resumed from {path} at step {info.step}; RNG {rng}", flush=True)
    return info.step


def _memory_tracker(model, opt):
    """torch's MemTracker for one step: peak memory by category (parameters, gradients,
    activations, optimizer state, temporaries) on every device. no_shard's kept gradient
    buckets are handed to it too (it files them under Other; the report counts them as
    gradients)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it warns about optimizer state entries that are None
        tracker.track_external(model, opt, *kept_buckets(model))
    return tracker


def _peak_by_category(tracker) -> dict[str, dict[str, int]]:
    out = {}
    for dev, cats in tracker.get_tracker_snapshot("peak").items():
        out[str(dev)] = {getattr(k, "value", str(k)): v for k, v in cats.items()}
    return out


class Progress:
    """Rank 0's progress: a tqdm bar (step, loss, tokens/s, ETA) on a terminal; elsewhere, or
    without tqdm, a plain line per update, which reads well in a log."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.total, self.start, self.enabled = total, start, enabled
        self.t0 = time.perf_counter()
        self.bar = None
        if enabled and sys.stdout.isatty() and importlib.util.find_spec("tqdm") is not None:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, initial=start, unit="step", file=sys.stdout, dynamic_ncols=True
            )

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            postfix = f"loss {loss:.3f}, {tokens_per_s / 1000:.1f}k tok/s"
            self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.update(step - self.bar.n)
        elif self.enabled:
            done = step - self.start
            eta = (time.perf_counter() - self.t0) / max(done, 1) * (self.total - step)
            print(
                f"step {step:>5}/{self.total}  loss {loss:6.3f}  "
                f"{tokens_per_s / 1000:6.1f}k tok/s  ETA {int(eta) // 60}:{int(eta) % 60:02d}",
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _mib(n: float) -> str:
    return f"{n / 2**20:8.2f}"


def render_summary(s: dict) -> str:
    """The closing table: what each rank held against DDP, and what it sent against theory."""
    rows, theory = s["rows"], s["theory"]
    n = s["world_size"]
    lines = [
        f"loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}   "
        f"{s['tokens_per_s'] / 1000:.1f}k tokens/s   {n} ranks on {s['device']}   "
        f"strategy {s['strategy']}, wrap {s['config']['wrap']}",
        "",
        "memory held per rank (MiB)      params    grads  optimizer    total   DDP total",
    ]
    ddp = rows[0]["ddp_params"] + rows[0]["ddp_grads"] + rows[0]["ddp_optimizer"]
    for r in rows:
        total = r["params"] + r["grads"] + r["optimizer"]
        lines.append(
            f"  rank {r['rank']:<24}{_mib(r['params'])} {_mib(r['grads'])} {_mib(r['optimizer'])}   "
            f"{_mib(total)}    {_mib(ddp)}"
        )
    lines += ["", "peak memory of one step per rank (MiB, torch MemTracker)   params    grads  activations  optimizer   temp    total"]
    for r in rows:
        for dev, c in sorted(r["peak"].items()):
            if dev == "meta" or not c.get("Total"):  # placeholders of sharded units hold nothing
                continue
            lines.append(
                f"  rank {r['rank']} {dev:<50}{_mib(c.get('Parameter', 0))} {_mib(c.get('Gradient', 0) + c.get('Other', 0))}"
                f"     {_mib(c.get('Activation', 0))}   {_mib(c.get('Optstate', 0))} {_mib(c.get('Temp', 0))} {_mib(c['Total'])}"
            )
    cfg = s["config"]
    lines.append(
        f"  mixed precision {cfg['mixed_precision']}, comm {cfg['comm']}, cpu offload {'on' if cfg['cpu_offload'] else 'off'}, "
        f"activation checkpointing {'on' if cfg['activation_checkpointing'] else 'off'}, "
        + (f"memory budget {cfg['memory_budget']} (the plan above, per block), " if cfg["memory_budget"] else "")
        + f"compiled blocks {'on' if cfg['compile'] else 'off'}"
    )
    hybrid = theory["replicate"] > 1
    lines += [
        "",
        "bytes sent per rank per step (MiB)   all-gather  reduce-scatter  all-reduce"
        + ("  replicate all-reduce" if hybrid else "")
        + "   total   step ms",
    ]
    for r in rows:
        across = r.get("replicate_all_reduce", 0)
        total = r["all_gather"] + r["reduce_scatter"] + r["all_reduce"] + across
        lines.append(
            f"  rank {r['rank']:<30}{_mib(r['all_gather'])}    {_mib(r['reduce_scatter'])}"
            f"   {_mib(r['all_reduce'])}"
            + (f"            {_mib(across)}" if hybrid else "")
            + f" {_mib(total)}  {r['step_ms']:8.1f}"
        )
    ranks = f"N = {n}" if not hybrid else f"N = {n} = R {theory['replicate']} x S {theory['shard']}"
    lines.append(
        f"  theory: {theory['formula']} = {theory['bytes'] / 2**20:.2f} MiB "
        f"(psi = {theory['psi']:,} parameters, b = {theory['b']} bytes, {ranks}); {theory['note']}"
    )
    if hybrid:
        within = [r["all_gather"] + r["reduce_scatter"] + r["all_reduce"] for r in rows]
        across = [r.get("replicate_all_reduce", 0) for r in rows]
        lines.append(
            f"  per link: within each shard group (S = {theory['shard']} ranks) theory "
            f"{theory['within'] / 2**20:.2f} MiB, measured {_mib(max(within)).strip()} MiB; across the "
            f"replicas (R = {theory['replicate']}) theory {theory['across'] / 2**20:.2f} MiB, "
            f"measured {_mib(max(across)).strip()} MiB (the most any rank sent)"
        )
    replica_groups = [r.get("replica_groups_all_reduce", 0) for r in rows]
    if any(replica_groups):
        lines.append(
            f"  across replica groups (--fault-tolerance, torchft): {_mib(max(replica_groups)).strip()} MiB per step "
            "(the most any rank sent; each rank averages its gradient shard with its peers in the other groups)"
        )
    return "\n".join(lines)
