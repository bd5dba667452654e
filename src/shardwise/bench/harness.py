"""Benchmark shardwise against PyTorch's FSDP2, DDP and the compute floor, in one run.

    shardwise bench --model small --nproc 2              # local ranks on CPU (Gloo), or:
    torchrun --nproc_per_node 8 -m shardwise bench --model large --mixed-precision bf16
    shardwise bench --nproc 4 --strategy hybrid_shard --shard-size 2   # against FSDP2's HSDP

Every rank runs every system in alternation (A B C A B C ...) for several rounds, after one
discarded visit that warms the process (allocator, kernels, connections): each visit
builds the system from the same seed, takes ``warmup`` untimed steps and ``steps`` timed ones on
the same batches, and frees it, so only one system's state is alive at a time. The compute
floor is the plain model on the per-rank batch with no communication, run on every rank at once
so that CPU contention matches. A step is forward, backward and ``AdamW.step()``; its time is
the slowest rank's. After the rounds, one more visit per system counts bytes and peak memory:
a dispatch mode sees every ``c10d`` collective of every system alike (bytes booked as a ring
moves them, as ``shardwise.comm_stats`` books its own; shardwise's Gloo gathers and
reduce-scatters, messages its posting thread posts out of the mode's sight, come from its own
books), and memory is torch's ``MemTracker`` on
CPU or ``torch.cuda.max_memory_allocated`` on CUDA. First-step losses must agree across systems.
On a shared machine it waits for other processes to go quiet before each visit and redoes a
visit they disturbed (``--quiet``; Linux ``/proc/stat``). Results: a markdown table on stdout,
``bench.json``, ``bench.md`` and ``bench.png`` (matplotlib, from the tools extra) in ``--out``.
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
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..core import groups
from ..core.codecs import FORMATS as WIRE_FORMATS
from ..core.codecs import Codec
from ..core.policies import STRATEGIES, Comm, Sharding
from ..observer import charts
from ..observer.accounting import theory
from . import counts as bench_counts
from . import machine
from .netns import link_rate
from .optimizers import OPTIMIZERS, exact_visit, make_optimizers, whole_matrix

SYSTEMS = (  # the default comparison: every strategy on one group of all ranks
    "floor",
    "ddp",
    "shardwise/no_shard",
    "fsdp2/full_shard",
    "shardwise/full_shard",
    "fsdp2/shard_grad_op",
    "shardwise/shard_grad_op",
)
# hybrid sharding on a 2-D mesh (replicas x shard groups of --shard-size): FSDP2's HSDP is
# fully_shard on the same DeviceMesh
HYBRID_SYSTEMS = (
    "fsdp2/hybrid_shard",
    "shardwise/hybrid_shard",
    "fsdp2/hybrid_shard_grad_op",
    "shardwise/hybrid_shard_grad_op",
)
# --optimizer muon: Muon on the blocks' matrices (owned; FSDP2's DTensors), and rows + AdamW
MUON_SYSTEMS = ("fsdp2/full_shard", "shardwise/full_shard+owned", "shardwise/full_shard")
KNOWN = SYSTEMS + HYBRID_SYSTEMS
# --nodes 2: across the shaped link between two namespaces (shardwise.bench.netns); a
# shardwise system may name its precision on the wire after a "+" (shardwise.Comm shorthands)
TWO_NODE_SYSTEMS = (
    "floor",
    "fsdp2/hybrid_shard",
    "shardwise/hybrid_shard",
    "shardwise/hybrid_shard+int8",
    "shardwise/hybrid_shard+replicate-int8",
    "shardwise/full_shard",
)


def strategy_of(system: str) -> Sharding | None:
    """The sharding strategy of a system's name ("shardwise/full_shard+owned": full_shard;
    the floor and DDP: None)."""
    name = system.partition("/")[2].partition("+")[0]
    return Sharding.of(name) if name else None


def is_hybrid(system: str) -> bool:
    strategy = strategy_of(system)
    return strategy is not None and strategy.hybrid


def systems_for(strategy: str) -> tuple[str, ...]:
    """The systems that ``--strategy`` compares: the floor, DDP, and both FSDPs under it."""
    sharding = Sharding.of(strategy)
    return ("floor", "ddp", *(s for s in SYSTEMS + HYBRID_SYSTEMS if strategy_of(s) is sharding))


MODELS = ("tiny", "small", "medium", "large", "mlp", "mha")
MLP_DIMS = [1024] * 9  # 8 Linear(1024, 1024) layers: 8.4M parameters
REDOS = 3  # times a visit is run again when other processes took more than --quiet of the CPU


@dataclass(frozen=True)
class BenchConfig:
    """Options of ``shardwise bench``; each is the CLI flag of the same name."""

    model: str = "small"  # built-in GPT size (tiny|small|medium|large), mlp (an MLPStack) or
    # mha (an MHAGPT of the small size: stock torch blocks, untied head, loss outside the model)
    nproc: int = 2  # ranks to launch on this machine (ignored under torchrun)
    batch_size: int = 4  # sequences (GPT) or rows (mlp) per rank per step
    seq_len: int = 128  # tokens per sequence (GPT)
    vocab_size: int = 256  # GPT vocabulary: the tokens are bytes; a larger one enlarges the
    # embedding, the head and the loss's temporaries (a real tokenizer's would)
    rounds: int = 6  # visits of each system, in alternation
    steps: int = 3  # timed steps per visit
    warmup: int = 2  # untimed steps per visit (DDP rebuilds its buckets in its second step)
    systems: tuple[str, ...] = SYSTEMS  # which systems to run (comma-separated on the CLI)
    shard_size: int = 0  # hybrid systems: ranks per shard group (0: LOCAL_WORLD_SIZE, one node)
    mixed_precision: str = "none"  # none | bf16 (autocast for DDP and the floor)
    compile: bool = False  # torch.compile every block of every system alike (inductor)
    seed: int = 0  # model initialisation and data
    threads: int = 1  # intra-op threads per rank (OMP_NUM_THREADS)
    out: str = "bench-out"  # directory for bench.json, bench.md and bench.png
    quiet: float = 0.10  # redo a visit if other processes took more of the CPU (1: never)
    optimizer: str = "adamw"  # adamw | muon (Muon on the blocks' matrices: bench_optim.py)

    comm: str = "exact"  # precision on the wire of shardwise systems without a "+" (exact|bf16|fp8|int8)
    nodes: int = 1  # 2: two nodes on this machine, --nproc ranks each, joined by a shaped link
    link: str = "1gbit"  # --nodes 2: the link's rate each way (tc units: 10gbit, 1gbit, 100mbit)

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r}: use one of {', '.join(MODELS)}")
        if bad := [s for s in self.systems if not _known(s)]:
            raise ValueError(
                f"unknown systems {bad}; valid: {', '.join(KNOWN)}, and shardwise ones with "
                f"+{'|+'.join(WIRE_FORMATS)}, +replica-{'|+replica-'.join(WIRE_FORMATS)} or +owned"
            )
        if self.comm != "exact" and self.comm not in WIRE_FORMATS:
            raise ValueError(f"comm={self.comm!r}: use exact or one of {', '.join(WIRE_FORMATS)}")
        if self.nodes not in (1, 2):
            raise ValueError(f"nodes={self.nodes}: use 1, or 2 (two namespaces joined by a link)")
        if self.shard_size < 0:
            raise ValueError(f"shard_size={self.shard_size} must be positive (0: one node)")
        if self.mixed_precision not in ("none", "bf16"):
            raise ValueError(f"mixed_precision={self.mixed_precision!r}: use none or bf16")
        if self.vocab_size < 256:
            raise ValueError(f"vocab_size={self.vocab_size}: the tokens are bytes, use at least 256")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
        if self.rounds < 1 or self.steps < 1 or self.warmup < 1:
            raise ValueError("rounds, steps and warmup must each be at least 1")


def _known(system: str) -> bool:
    base, plus, variant = system.partition("+")
    if not plus:
        return base in KNOWN
    replica = variant.removeprefix("replicate-")
    return base.startswith("shardwise/") and base in KNOWN and (replica in WIRE_FORMATS or variant == "owned")


def _comm_of(system: str, cfg: BenchConfig) -> Comm | str | None:
    """A shardwise system's precision on the wire: after its "+" (``replicate-int8``: only the
    all-reduce across shard groups, the link between nodes), else ``--comm``."""
    variant = system.partition("+")[2]
    if variant.startswith("replicate-"):
        return Comm(replicate=variant.removeprefix("replicate-"))
    wire = variant if variant in WIRE_FORMATS else cfg.comm
    return None if wire == "exact" else wire


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    d = BenchConfig()
    p = argparse.ArgumentParser(prog="shardwise bench", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, default=d.model, help="GPT size, mlp, or mha (MHAGPT small)")
    p.add_argument("--nproc", type=int, default=d.nproc, help="local ranks (ignored under torchrun)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences or rows per rank")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence (GPT)")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help="GPT vocabulary (at least 256)")
    p.add_argument("--rounds", type=int, default=d.rounds, help="visits of each system")
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps per visit")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps per visit")
    p.add_argument("--systems", help=f"comma-separated subset of: {', '.join(KNOWN)} (default: {', '.join(SYSTEMS)})")
    p.add_argument("--strategy", choices=STRATEGIES,
                   help="compare under one strategy: the floor, DDP, FSDP2 and shardwise (instead of --systems)")
    p.add_argument("--shard-size", type=int, default=d.shard_size,
                   help="hybrid strategies: ranks per shard group (default: the ranks of one node)")
    p.add_argument("--mixed-precision", choices=("none", "bf16"), default=d.mixed_precision)
    p.add_argument("--comm", choices=("exact", *WIRE_FORMATS), default=d.comm,
                   help='precision on the wire of shardwise systems (a system may say its own: "+int8")')
    p.add_argument("--nodes", type=int, choices=(1, 2), default=d.nodes,
                   help="2: two nodes of --nproc ranks, network namespaces joined by a shaped veth link (root)")
    p.add_argument("--link", type=link_rate, default=d.link, help="--nodes 2: the link's rate each way (tc units)")
    p.add_argument("--compile", action="store_true", help="torch.compile each block of every system alike")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=d.optimizer,
                   help="muon: Muon on the blocks' matrices, AdamW on the rest (shardwise owned, FSDP2), "
                   "against shardwise rows + AdamW (the default systems then)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads, help="intra-op threads per rank")
    p.add_argument("--out", default=d.out, help="output directory")
    p.add_argument("--quiet", type=float, default=d.quiet,
                   help=f"redo a visit (up to {REDOS} times) when other processes took more than this share "
                   "of the machine's CPU during it, and wait for such a quiet machine before each (1: never)")
    a = vars(p.parse_args(argv))
    strategy, systems = a.pop("strategy"), a.pop("systems")
    if strategy is not None and systems is not None:
        p.error("pass --strategy or --systems, not both")
    if strategy is not None:
        a["systems"] = systems_for(strategy)
    elif systems is not None:
        a["systems"] = tuple(s.strip() for s in systems.split(",") if s.strip())
    else:
        a["systems"] = TWO_NODE_SYSTEMS if a["nodes"] == 2 else MUON_SYSTEMS if a["optimizer"] == "muon" else SYSTEMS
    return BenchConfig(**a)


def main(argv: list[str] | None = None) -> None:
    """Run the comparison: under torchrun in its ranks, else in ``--nproc`` local ranks."""
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_args(argv)
    if "RANK" in os.environ:
        results = run_rank(cfg)
        if dist.get_rank() == 0:
            report(summarize(cfg, results), cfg.out)
        return
    if cfg.nodes == 2:
        _across_a_link(cfg, sys.argv[1:] if argv is None else argv)
        return
    os.environ["OMP_NUM_THREADS"] = str(cfg.threads)  # read by torch as each rank starts
    results = groups.launch_local(cfg.nproc, run_rank, cfg)[0]
    report(summarize(cfg, results), cfg.out)


def _across_a_link(cfg: BenchConfig, argv: list[str]) -> None:
    """Run this benchmark as two torchrun agents, one per namespace, over a link shaped to
    ``--link``; rank 0 (node A) writes the results."""
    from .netns import two_nodes, unavailable, without_nproc

    why = unavailable()
    if why:
        raise SystemExit(f"shardwise bench --nodes 2: {why}")
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    env = {"OMP_NUM_THREADS": str(cfg.threads)}
    with two_nodes(rate=cfg.link) as link:
        args = ["-m", "shardwise", "bench", *without_nproc(argv)]
        agents = [
            link.agent(node, cfg.nproc, args, run_id=f"bench-{os.getpid()}", env=env) for node in (0, 1)
        ]
        codes = [a.wait() for a in agents]
    if any(codes):
        raise SystemExit(f"shardwise bench --nodes 2: the agents exited with {codes}")


# --------------------------------------------------------------------------- models and systems
@dataclass
class Workload:
    """The model builder, wrap class and per-rank batches every system trains on."""

    build: Callable[[], nn.Module]  # call after seeding
    block: type[nn.Module]  # the class that shardwise and FSDP2 wrap
    batches: list[tuple[torch.Tensor, torch.Tensor]]  # this rank's (input, target) per step
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]  # the scalar loss
    tokens_per_step: int  # over all ranks (rows, for mlp)
    num_params: int
    root_params: int  # parameters outside every block: the root unit's
    trained_tensors: int  # parameters that train: one flag each in shardwise's step check


def workload(cfg: BenchConfig, rank: int, world: int, device: torch.device) -> Workload:
    """The model and data for ``cfg.model``: the same seed and batches on every system."""
    from ..job.data import get_batch, rank_slice
    from ..job.models import GPT, MHAGPT, Block, Layer, MHABlock, MLPStack, gpt_config

    rows = cfg.batch_size * world  # one global batch per step, split among the ranks
    mha = cfg.model == "mha"
    if cfg.model == "mlp":
        block, tokens = Layer, rows

        def build() -> nn.Module:
            return MLPStack(MLP_DIMS)

        def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
            return torch.randn(rows, MLP_DIMS[0], generator=g), torch.randn(rows, MLP_DIMS[-1], generator=g)

        def loss(model, x, y):
            return F.mse_loss(model(x), y)
    else:
        mcfg = gpt_config("small" if mha else cfg.model, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size)
        block, tokens = (MHABlock if mha else Block), rows * cfg.seq_len

        def build() -> nn.Module:
            return MHAGPT(mcfg) if mha else GPT(mcfg)

        def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            return get_batch(step, rows, cfg.seq_len, seed=cfg.seed)

        def loss(model, x, y):
            if mha:  # the loss outside the model, as most training loops have it
                return F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            return model(x, y)

    batches = [
        tuple(rank_slice(t, rank, world).to(device) for t in batch(step))
        for step in range(cfg.warmup + cfg.steps)
    ]
    torch.manual_seed(cfg.seed)
    probe = build()
    total = sum(p.numel() for p in probe.parameters())
    in_blocks = {id(p) for m in probe.modules() if isinstance(m, block) for p in m.parameters()}
    root = sum(p.numel() for p in probe.parameters() if id(p) not in in_blocks)
    trained = sum(p.requires_grad for p in probe.parameters())
    return Workload(build, block, batches, loss, tokens, total, root, trained)


def device_meshes(cfg: BenchConfig, device: torch.device) -> dict[int, object]:
    """The DeviceMeshes the systems need (collective): 1, every rank in one group (FSDP2);
    2, replicas x shard groups of ``--shard-size`` (FSDP2's HSDP and shardwise's hybrid)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    meshes: dict[int, object] = {}
    if any(s.startswith("fsdp2/") and not is_hybrid(s) for s in cfg.systems):
        meshes[1] = init_device_mesh(device.type, (world,))
    if any(is_hybrid(s) for s in cfg.systems):
        size = cfg.shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if world % size:
            raise ValueError(f"--shard-size {size} does not divide the {world} ranks")
        meshes[2] = init_device_mesh(device.type, (world // size, size), mesh_dim_names=("replicate", "shard"))
    return meshes


def build_system(name: str, cfg: BenchConfig, work: Workload, device: torch.device, meshes: dict):
    """A fresh model of system ``name`` from the seed, its optimizers (``bench_optim``), and the
    forward's context (``meshes``: from ``device_meshes``)."""
    from .. import api
    from ..core import placement, wrap

    torch.manual_seed(cfg.seed)
    model = work.build().to(device)
    bf16 = cfg.mixed_precision == "bf16"
    autocast = contextlib.nullcontext
    kind, strategy = name.partition("/")[0], strategy_of(name)
    hybrid = is_hybrid(name)
    mesh = meshes.get(2 if hybrid else 1)
    if kind == "shardwise":
        api.shard(
            model,
            wrap=wrap.by_class(work.block),
            strategy=strategy,
            mesh=mesh if hybrid else None,  # the same 2-D mesh as FSDP2's HSDP
            mixed_precision="bf16" if bf16 else None,
            placement=placement.matrices if name.endswith("+owned") else None,
            comm=_comm_of(name, cfg),
        )
    elif kind == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()
        reshard = strategy.reshard_after_forward
        for m in model.modules():
            if isinstance(m, work.block):
                fully_shard(m, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
        # the root keeps its default: not resharded after forward, as shardwise's root unit
        fully_shard(model, mesh=mesh, mp_policy=mp)
    elif kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    if cfg.compile:
        _compile_blocks(model, work.block)
    if bf16 and kind in ("ddp", "floor"):

        def autocast():
            return torch.autocast(device.type, dtype=torch.bfloat16)

    return model, make_optimizers(name, model, work.block, cfg.optimizer), autocast


def _compile_blocks(model: nn.Module, block: type[nn.Module]) -> None:
    """Compile each block of a freshly built system (its first warm-up step compiles), from
    an empty dynamo cache: no system reuses another's graphs or meets the recompile limit."""
    torch._dynamo.reset()
    for m in model.modules():
        if isinstance(m, block):
            m.compile()


def train_step(model, opts: list, autocast, work: Workload, x, y) -> tuple[torch.Tensor, float]:
    """One step; returns the loss and the seconds its optimizers' steps took."""
    with autocast():
        loss = work.loss(model, x, y)
    loss.backward()
    _sync(loss.device)
    t0 = time.perf_counter()
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)
    _sync(loss.device)
    return loss.detach(), time.perf_counter() - t0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- what each rank runs
def run_rank(cfg: BenchConfig) -> dict:
    """One rank's part: the timed rounds, then one counted visit per system. Returns every
    rank's raw results and the workload's sizes (collective: call on every rank)."""
    groups.init()
    torch.set_num_threads(cfg.threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = groups.device()
    work = workload(cfg, rank, world, device)
    meshes = device_meshes(cfg, device)
    out: dict[str, dict] = {s: {"visits": []} for s in cfg.systems}
    timed_visit(cfg.systems[0], cfg, work, device, meshes)  # discarded: the process's first steps are slow
    for r in range(cfg.rounds):
        for name in cfg.systems:
            for attempt in range(1 + REDOS):
                quiet = machine.wait_until_quiet(cfg.quiet)
                visit = timed_visit(name, cfg, work, device, meshes)
                visit["others_load"] = machine.others_load(visit)
                if visit["others_load"] <= cfg.quiet or not quiet or attempt == REDOS:
                    break  # (a machine that never fell quiet gets no redo: it would not help)
            visit["attempts"] = attempt + 1
            out[name]["visits"].append(visit)
            if rank == 0:
                ms, others = 1e3 * statistics.median(visit["times"]), 100 * visit["others_load"]
                print(f"round {r + 1}/{cfg.rounds} {name}: {ms:.1f} ms (others {others:.0f}%, try {attempt + 1})",
                      file=sys.stderr, flush=True)
    for name in cfg.systems:
        out[name].update(counted_visit(name, cfg, work, device, meshes))
        if cfg.optimizer == "muon":
            out[name]["max_diff"] = exact_visit(
                name, lambda n: build_system(n, cfg, work, device, meshes), train_step, work, cfg.optimizer, cfg.seed
            )
        if rank == 0:
            print(f"counted {name}", file=sys.stderr, flush=True)
    everyone = [None] * world
    dist.all_gather_object(everyone, out)
    return {
        "ranks": everyone,
        "mesh": list(meshes[2].shape) if 2 in meshes else None,  # (replicas, shard group size)
        "num_params": work.num_params,
        "root_params": work.root_params,
        "trained_tensors": work.trained_tensors,
        "tokens_per_step": work.tokens_per_step,
        "device": device.type,
        "machine": machine.describe(device.type),
    }


def timed_visit(name: str, cfg: BenchConfig, work: Workload, device: torch.device, meshes) -> dict:
    """Build ``name`` from the seed, run its warm-up and timed steps, free it; return the
    step times, the first step's loss and, per timed step, this process's CPU seconds (all its
    threads, Gloo's included) and the whole machine's busy CPU seconds (Linux)."""
    from ..core.collectives import comm_stats, reset_comm_stats

    model, opts, autocast = build_system(name, cfg, work, device, meshes)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    visit = {"times": [], "opt_times": [], "own_cpu": [], "busy": [], "first_loss": None}
    for i, (x, y) in enumerate(work.batches):
        if i == cfg.warmup:
            reset_comm_stats()
        dist.barrier()
        busy0, cpu0 = machine.busy_s(), time.process_time()
        t0 = time.perf_counter()
        loss, opt_s = train_step(model, opts, autocast, work, x, y)
        _sync(device)
        dt = time.perf_counter() - t0
        if i == 0:
            visit["first_loss"] = loss.item()
        if i >= cfg.warmup:
            visit["times"].append(dt)
            visit["opt_times"].append(opt_s)
            visit["own_cpu"].append(time.process_time() - cpu0)
            visit["busy"].append(machine.busy_s() - busy0)
    visit["wait_s"] = sum(s.wait_seconds for s in comm_stats(reset=True).values())
    visit["peak_cuda"] = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    del model, opts, autocast, loss
    gc.collect()  # the system's reference cycles too: the next visit starts clean
    return visit


def counted_visit(name: str, cfg: BenchConfig, work: Workload, device: torch.device, meshes) -> dict:
    """One more visit of ``name``: after the warm-up steps, one step under ``CommCounter`` and,
    on CPU, one under ``MemTracker`` (both slow every op down, so no timed step runs under them)."""
    from ..core.collectives import comm_stats, reset_comm_stats

    model, opts, autocast = build_system(name, cfg, work, device, meshes)
    ddp = bench_counts.ddp_buckets(model) if device.type == "cpu" else None
    for x, y in work.batches[: cfg.warmup]:
        train_step(model, opts, autocast, work, x, y)
    x, y = work.batches[-1]
    reset_comm_stats()
    counter = bench_counts.CommCounter(dist.get_world_size())
    if ddp is not None:
        ddp.clear()  # the buckets as this step uses them (DDP rebuilds them after its first)
    with counter:
        train_step(model, opts, autocast, work, x, y)
    own = {k: v.bytes for k, v in comm_stats(reset=True).items() if v.bytes}
    counted = dict(counter.bytes)
    if name.startswith("shardwise") and "send" not in counted:
        # on Gloo its gathers and reduce-scatters are messages its posting thread posts, out
        # of the counter's sight (a dispatch mode sees its own thread): from its own books
        counted.update({k: own[k] for k in ("all_gather", "reduce_scatter") if k in own})
    if name.startswith("shardwise") and _comm_of(name, cfg) is not None:
        # encoded all-reduces are messages too (Note [wire precision] in collectives.py)
        counted["all_reduce"] = counted.get("all_reduce", 0) + own.get("all_reduce", 0)
        if own.get("replicate_all_reduce"):
            counted["replicate_all_reduce"] = own["replicate_all_reduce"]
    res = {"bytes": counted, "shardwise_bytes": own, "unknown_collectives": sorted(counter.unknown)}
    if device.type == "cpu":
        kept = bench_counts.kept_buckets(model, ddp)
        res["peak_tracker"] = bench_counts.tracked_peak(
            model, opts, kept, partial(train_step, model, opts, autocast, work, x, y)
        )
    del model, opts, autocast, ddp
    gc.collect()
    return res


# --------------------------------------------------------------------------- summary
def _theory(system: str, cfg: BenchConfig, results: dict) -> int:
    """Bytes per rank per step in theory for ``system`` (``accounting.theory``: ring
    collectives; the root stays gathered from forward to backward, in shardwise as in FSDP2;
    hybrid systems on the results' mesh; shardwise's step check)."""
    if system == "floor":
        return 0
    psi = results["num_params"]
    wire = system.partition("+")[2] or (cfg.comm if system.startswith("shardwise") else "exact")
    b_gather, b_reduce, b_across = (2 if cfg.mixed_precision == "bf16" else 4), 4, 4
    if wire in WIRE_FORMATS:  # bytes per element on the wire, scales included (blocks of the whole)
        b_gather = b_reduce = b_across = Codec(wire).nbytes(psi) / psi
    elif wire.startswith("replica-"):
        b_across = Codec(wire.removeprefix("replicate-")).nbytes(psi) / psi
    kinds = theory(
        strategy_of(system) or Sharding.NO_SHARD,  # DDP's theory is no_shard's
        psi,
        world=len(results["ranks"]),
        replicate=results["mesh"][0] if results.get("mesh") else 1,
        b_gather=b_gather,
        b_reduce=b_reduce,
        b_across=b_across,
        root=results["root_params"],
        trained=results["trained_tensors"] if system.startswith("shardwise") else None,
    )
    return int(sum(kinds.values()))


def summarize(cfg: BenchConfig, results: dict) -> dict:
    """Per system: step-time statistics over the slowest rank of each step, tokens/s, peak
    memory (the largest rank's), bytes per step, the ratios, and the first-loss check."""
    ranks = results["ranks"]
    world = len(ranks)
    rows = {}
    for name in cfg.systems:
        per_rank = [r[name] for r in ranks]
        visits = [list(v) for v in zip(*(p["visits"] for p in per_rank))]  # [visit][rank]
        kept = [v for v in visits if v[0]["others_load"] <= cfg.quiet]
        if len(kept) < min(2, len(visits)):  # never quiet enough: keep them all (the table says so)
            kept = visits
        steps = [max(ts) for v in kept for ts in zip(*(r["times"] for r in v))]
        med = statistics.median(steps)
        peak = max(
            p.get("peak_tracker", {}).get("Total", 0) or max(v["peak_cuda"] for v in p["visits"])
            for p in per_rank
        )
        rows[name] = {
            "median_ms": 1e3 * med,
            "p25_ms": 1e3 * float(np.percentile(steps, 25)),
            "p75_ms": 1e3 * float(np.percentile(steps, 75)),
            "step_ms": [1e3 * t for t in steps],
            "cpu_ms_per_rank": 1e3
            * statistics.median(c for v in kept for r in v for c in r["own_cpu"]),
            "visits_kept": len(kept),
            "others_load": [v[0]["others_load"] for v in visits],
            "redone_visits": sum(v[0]["attempts"] - 1 for v in visits),
            "tokens_per_s": results["tokens_per_step"] / med,
            "peak_bytes": peak,
            "peak_breakdown": ranks[0][name].get("peak_tracker"),
            # the ranks' mean: with owned parameters each rank sends the whole less its share
            "bytes_per_step": statistics.mean(sum(r[name]["bytes"].values()) for r in ranks),
            "bytes_by_kind": ranks[0][name]["bytes"],
            "shardwise_comm_stats_bytes": ranks[0][name]["shardwise_bytes"],
            "theory_bytes": _theory(name, cfg, results),
            "wait_ms_per_step": 1e3 * sum(v[0]["wait_s"] for v in kept) / len(steps),
            # the slowest rank's optimizer steps (an owner orthogonalizes its matrices alone)
            "opt_ms": 1e3 * statistics.median(max(ts) for v in kept for ts in zip(*(r["opt_times"] for r in v))),
            "max_diff": ranks[0][name].get("max_diff"),
            "first_losses": [[v["first_loss"] for v in p["visits"]] for p in per_rank],
            "unknown_collectives": ranks[0][name]["unknown_collectives"],
        }
    for name, row in rows.items():
        ours, fsdp2 = name.startswith("shardwise/"), rows.get(f"fsdp2/{strategy_of(name)}")
        row["x_floor"] = _ratio(row, rows.get("floor"))
        row["x_fsdp2"] = _ratio(row, fsdp2) if ours else None
        row["opt_x_fsdp2"] = _ratio(row, fsdp2, "opt_ms") if ours else None
        row["x_ddp"] = _ratio(row, rows.get("ddp")) if ours else None
    return {
        "config": asdict(cfg),
        "world_size": world,
        "mesh": results.get("mesh"),
        "num_params": results["num_params"],
        "tokens_per_step": results["tokens_per_step"],
        "machine": results["machine"],
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "memory_tool": "torch.cuda.max_memory_allocated"
        if results["device"] == "cuda"
        else "torch.distributed._tools.mem_tracker.MemTracker",
        "systems": rows,
        # encoded systems compute on weights within their codec's bound: their loss differs a little
        "loss_check": _loss_check(
            rows, tol=1e-2 if cfg.mixed_precision == "bf16" or any("+" in s for s in rows) else 1e-4
        ),
    }


def _ratio(row: dict, base: dict | None, key: str = "median_ms") -> float | None:
    return row[key] / base[key] if base else None


def _loss_check(rows: dict, tol: float) -> dict:
    """Every visit's first-step loss, per rank, against the first system's: the same work."""
    ref_name = next(iter(rows))
    ref = rows[ref_name]["first_losses"][0][0]
    worst, where = 0.0, ""
    for name, row in rows.items():
        for rank, losses in enumerate(row["first_losses"]):
            base = rows[ref_name]["first_losses"][rank][0]
            for loss in losses:
                rel = abs(loss - base) / max(abs(base), 1e-12)
                if rel > worst:
                    worst, where = rel, f"{name} on rank {rank}: {loss} vs {ref_name}'s {base}"
    return {"ok": worst <= tol, "tolerance": tol, "worst_rel_diff": worst, "worst": where, "rank0_loss": ref}


# --------------------------------------------------------------------------- output
def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def render_markdown(summary: dict) -> str:
    """The results table (and how it was made) as markdown."""
    c = summary["config"]
    muon = c.get("optimizer") == "muon"
    columns = _columns(c, muon)
    return "\n".join([
        _setup_line(summary),
        "",
        "| " + " | ".join(head for head, _, _ in columns) + " |",
        "|" + "|".join("---:" if right else "---" for _, right, _ in columns) + "|",
        *("| " + " | ".join(cell(n, r) for *_, cell in columns) + " |" for n, r in summary["systems"].items()),
        "",
        *_notes(summary, muon),
    ])


def _setup_line(summary: dict) -> str:
    """How the table was made: machine, ranks, link, model, batch, precision, rounds, date."""
    c = summary["config"]
    return (
        f"{summary['machine']}; {summary['world_size']} ranks"
        + (
            f" (hybrid: {summary['mesh'][0]} replicas x shard groups of {summary['mesh'][1]})"
            if summary.get("mesh")
            else ""
        )
        + (
            f", 2 nodes of {summary['world_size'] // 2} joined by a {c['link']} link each way (network "
            "namespaces, a veth pair shaped with tc tbf)"
            if c.get("nodes") == 2
            else ""
        )
        + (f", shardwise systems' comm {c['comm']}" if c.get("comm", "exact") != "exact" else "")
        + f", {c['threads']} thread(s) each; "
        f"model {c['model']} ({summary['num_params'] / 1e6:.1f}M parameters), batch {c['batch_size']}"
        + (f" x {c['seq_len']} tokens" if c["model"] != "mlp" else " rows")
        + (f" of a {c['vocab_size']}-token vocabulary" if c.get("vocab_size", 256) != 256 else "")
        + f" per rank, {c['mixed_precision'] if c['mixed_precision'] != 'none' else 'fp32'}"
        + (", every block compiled (torch.compile)" if c.get("compile") else "")
        + "; "
        f"{c['rounds']} rounds x {c['steps']} timed steps (after {c['warmup']} warm-up) per system; "
        f"{summary['date']}"
    )


def _columns(c: dict, muon: bool) -> list[tuple[str, bool, Callable[[str, dict], str]]]:
    """The table's columns: header, right-aligned, cell of (system name, row)."""
    columns = [
        ("system", False, lambda n, r: n),
        ("median ms", True, lambda n, r: f"{r['median_ms']:.1f}"),
        ("p25-p75 ms", True, lambda n, r: f"{r['p25_ms']:.1f}-{r['p75_ms']:.1f}"),
        ("visits", True, lambda n, r: f"{r['visits_kept']}/{len(r['others_load'])}"),
        (f"{'rows' if c['model'] == 'mlp' else 'tokens'}/s", True, lambda n, r: f"{r['tokens_per_s']:,.0f}"),
        ("peak MiB", True, lambda n, r: f"{r['peak_bytes'] / 2**20:.1f}"),
        ("comm MiB/step", True, lambda n, r: f"{r['bytes_per_step'] / 2**20:.2f}"),
        ("theory MiB", True, lambda n, r: f"{r['theory_bytes'] / 2**20:.2f}"),
        ("x floor", True, lambda n, r: _fmt(r["x_floor"], ".2f")),
        ("x FSDP2", True, lambda n, r: _fmt(r["x_fsdp2"], ".2f")),
        ("x DDP", True, lambda n, r: _fmt(r["x_ddp"], ".2f")),
    ]
    if muon:
        columns += [
            ("optimizer", False, lambda n, r: "Muon + AdamW" if whole_matrix(n, "muon") else "AdamW"),
            ("opt ms", True, lambda n, r: f"{r['opt_ms']:.1f}"),
            ("opt x FSDP2", True, lambda n, r: _fmt(r["opt_x_fsdp2"], ".2f")),
            ("matrices' max abs diff vs 1 process", True, lambda n, r: _fmt(r["max_diff"], ".1e")),
        ]
    return columns


def _notes(summary: dict, muon: bool) -> list[str]:
    """Below the table: how step time, memory and bytes were measured; the loss check."""
    c, lc = summary["config"], summary["loss_check"]
    load = [f for r in summary["systems"].values() for f in r["others_load"]]
    redone = sum(r["redone_visits"] for r in summary["systems"].values())
    lines = [
        (
            "Step time: the slowest rank's, over the timed steps of the visits kept ('visits'): "
            f"those during which other processes took at most {100 * c['quiet']:.0f}% of the "
            "machine's CPU (all visits, if fewer than two were). Other processes took a median "
            f"{100 * statistics.median(load):.0f}% (worst visit {100 * max(load):.0f}%); "
            f"{redone} visit(s) were run again for it."
        ),
        (
            f"Peak memory: {summary['memory_tool']}, per rank (largest rank). Communication: every "
            "c10d collective counted by a dispatch mode, as bytes a ring moves per rank, the ranks' mean (on Gloo, "
            "shardwise's gathers and reduce-scatters from its own counters: they are messages "
            "posted by a thread of its own, out of the mode's sight). First-step "
            f"losses {'agree' if lc['ok'] else 'DISAGREE'} (worst relative difference "
            f"{lc['worst_rel_diff']:.1e}, tolerance {lc['tolerance']:.0e})."
        ),
    ]
    if muon:
        lines.append(
            "Optimizer: Muon (torch.optim.Muon, lr 2e-2) on the blocks' matrices and AdamW on the "
            "rest; shardwise in rows keeps AdamW everywhere (Muon on row slices is refused). 'opt "
            "ms': the slowest rank's optimizer steps. 'max abs diff': the largest parameter "
            "difference after all the visit's steps from one process training the same "
            "optimizers on the global batches, with Muon's Newton–Schulz in fp32 in both (in "
            "bf16, rounding flips make every data-parallel run drift ~1e-3)."
        )
    return lines


def report(summary: dict, out: str) -> None:
    """Print the table; write bench.json, bench.md and bench.png (with matplotlib); fail if
    the losses differ."""
    md = render_markdown(summary)
    print(md, flush=True)
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    (d / "bench.json").write_text(json.dumps(summary, indent=2) + "\n")
    (d / "bench.md").write_text(md + "\n")
    written = [d / "bench.json", d / "bench.md"]
    if charts.available():
        charts.bench_chart(summary, d / "bench.png")
        written.append(d / "bench.png")
    else:
        print(f"\nno chart: matplotlib is not installed ({charts.INSTALL})", flush=True)
    print(f"\nwrote {', '.join(map(str, written))}", flush=True)
    if not summary["loss_check"]["ok"]:
        raise SystemExit(f"first-step losses disagree: {summary['loss_check']['worst']}")
