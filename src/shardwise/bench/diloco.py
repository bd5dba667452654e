"""``shardwise bench --nodes 2 --diloco``: DiLoCo across a shaped link, against per-step
averaging, in one run.

Two network namespaces joined by a veth pair shaped to ``--link`` each way (bench/netns.py),
``--nproc`` ranks in each, the built-in GPT. Each system trains ``--rounds`` timed rounds of
``--sync-every`` steps after one untimed round (a per-step system ``--exact-steps`` steps
after 2 untimed: its steps are alike):

- ``alone``: each node its own job (full_shard over its ranks), nothing across the link: the
  ceiling DiLoCo is held to;
- ``shardwise/hybrid_shard`` and ``fsdp2/hybrid_shard``: one job over both nodes, sharded
  within a node and every gradient averaged across the link each step (exact hybrid sharding,
  FSDP2's HSDP on the same 2-D mesh);
- ``diloco+int8`` and ``diloco+topk``: each node its own job (full_shard), one torchft replica
  group each (``Torchft.diloco``, lighthouse on node A), pseudo-gradients averaged every
  ``--sync-every`` steps, encoded (streaming DiLoCo with ``--fragments`` F: a fragment
  every ``--sync-every`` / F steps, its exchange overlapping ``--fragment-sync-delay`` inner
  steps); ``diloco+fp32`` (not run by default) sends them in fp32,
  which separates what the encoding costs in loss from what DiLoCo itself does. The outer
  optimizer is Nesterov SGD with ``--outer-lr`` and ``--outer-momentum`` (plain SGD at 0).

``--warmup-steps W`` > 0 (the papers' per-step warm-up): exact hybrid sharding saves its model
and AdamW after its first W steps (OUT/warmup-W, a shardwise checkpoint; inside its timed steps
where W > 2: a run for loss curves, not timings) and the DiLoCo systems, listed after it, start
from it at step W's batch with their outer momentum at zero, so they end at step W + (rounds +
1) x sync-every: equal tokens where exact hybrid trains that many (benchmarks/convergence.py).

Every system trains the same tokens from the same initial model, with AdamW at ``--lr``
(DiLoCo's inner optimizer): step s's global batch
(``--batch-size`` sequences per rank, over both nodes' ranks) split in rank order, node B's
ranks taking the rows after node A's, whether the nodes form one job or two, so that the
losses compare at equal tokens (benchmarks/convergence.py).

What crosses the link is read from node A's veth counters (bytes sent plus received, over the
timed steps: everything, the lighthouse's heartbeats and quorums included), per token trained
on both nodes. Writes OUT/diloco.json (with each system's loss at every step: the mean of
each node's first rank's) and OUT/diloco.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

SYSTEMS = ("alone", "shardwise/hybrid_shard", "fsdp2/hybrid_shard", "diloco+int8", "diloco+topk")
KNOWN = (*SYSTEMS, "diloco+fp32")
LIGHTHOUSE_PORT = 29611


@dataclass(frozen=True)
class DilocoBench:
    """Options of ``shardwise bench --nodes 2 --diloco``; each is the CLI flag of the same name."""

    link: str = "100mbit"  # the link's rate each way (tc units)
    sync_every: int = 32  # DiLoCo's inner steps per round (H)
    fragments: int = 1  # streaming DiLoCo's fragments (F), synced in turn
    fragment_sync_delay: int = 0  # inner steps a fragment's exchange overlaps (D)
    rounds: int = 2  # timed rounds (of --sync-every steps), after one untimed
    exact_steps: int = 4  # timed steps of the per-step systems (after 2 untimed): each is alike
    model: str = "small"  # built-in GPT size
    nproc: int = 2  # ranks per node
    batch_size: int = 4  # sequences per rank per step
    seq_len: int = 128
    systems: tuple[str, ...] = SYSTEMS
    out: str = "bench-out"
    seed: int = 0
    outer_lr: float = 0.7  # DiLoCo's outer Nesterov SGD
    outer_momentum: float = 0.9  # (0: plain SGD)
    warmup_steps: int = 0  # DiLoCo starts from exact hybrid sharding's step W (0: from the initial model)
    lr: float = 1e-3  # AdamW's (every system's, DiLoCo's inner optimizer's)


def parse_args(argv: list[str]) -> tuple[DilocoBench, str | None]:
    """The options, and (in a worker) the system it runs."""
    from .netns import link_rate

    d = DilocoBench()
    p = argparse.ArgumentParser(prog="shardwise bench --nodes 2 --diloco", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, choices=(2,), default=2, help="always 2: two namespaces joined by a link")
    p.add_argument("--link", type=link_rate, default=d.link)
    p.add_argument("--sync-every", type=int, default=d.sync_every)
    p.add_argument("--fragments", type=int, default=d.fragments)
    p.add_argument("--fragment-sync-delay", type=int, default=d.fragment_sync_delay)
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--exact-steps", type=int, default=d.exact_steps)
    p.add_argument("--model", default=d.model, choices=("tiny", "small", "medium", "large"))
    p.add_argument("--nproc", type=int, default=d.nproc)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--systems", type=lambda s: tuple(s.split(",")), default=d.systems)
    p.add_argument("--out", default=d.out)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--outer-lr", type=float, default=d.outer_lr)
    p.add_argument("--outer-momentum", type=float, default=d.outer_momentum)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--system", help=argparse.SUPPRESS)  # (a worker's)
    a = vars(p.parse_args(argv))
    system = a.pop("system")
    a.pop("nodes")
    if unknown := [s for s in a["systems"] if s not in KNOWN]:
        p.error(f"--systems: unknown {unknown}; choose among {','.join(KNOWN)}")
    if min(a["sync_every"], a["rounds"], a["exact_steps"]) < 1:
        p.error("--sync-every, --rounds and --exact-steps are >= 1")
    if a["outer_lr"] <= 0 or not 0 <= a["outer_momentum"] < 1:
        p.error("--outer-lr is > 0 and --outer-momentum in [0, 1)")
    if a["warmup_steps"] and system is None:
        exact, dilocos = "shardwise/hybrid_shard", [s for s in a["systems"] if s.startswith("diloco")]
        if exact not in a["systems"] or any(a["systems"].index(s) < a["systems"].index(exact) for s in dilocos):
            p.error(f"--warmup-steps: DiLoCo starts from {exact}'s checkpoint: list {exact} first in --systems")
        if not 0 < a["warmup_steps"] <= 2 + a["exact_steps"]:
            p.error(f"--warmup-steps {a['warmup_steps']}: {exact} trains 2 + --exact-steps steps, save at one of them")
    if a["warmup_steps"] < 0:
        p.error("--warmup-steps is >= 0")
    return DilocoBench(**a), system


def main(argv: list[str] | None = None) -> None:
    b, system = parse_args(sys.argv[1:] if argv is None else argv)
    if system is not None:
        return worker(b, system)
    from .netns import unavailable

    if why := unavailable():
        raise SystemExit(f"shardwise bench --nodes 2 --diloco: {why}")
    out = Path(b.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {name: run_system(b, name) for name in b.systems}
    summary = {"config": asdict(b), "rows": rows}
    (out / "diloco.json").write_text(json.dumps(summary, indent=1))
    (out / "diloco.md").write_text(render(summary))
    print(render(summary))


def run_system(b: DilocoBench, name: str) -> dict:
    """Run one system in fresh namespaces; its row: tokens/s over both nodes, link bytes."""
    from .netns import ADDRESSES, two_nodes

    out = Path(b.out)
    args = ["-m", "shardwise.bench.diloco", *_flags(b), "--system", name]
    env = {"OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    with two_nodes(rate=b.link) as link:
        lighthouse = None
        if name.startswith("diloco"):
            lighthouse = link.run(0, [sys.executable, "-m", "shardwise", "lighthouse", "--port", str(LIGHTHOUSE_PORT),
                                      "--bind", ADDRESSES[0], "--min-replicas", "2"], session=True,
                                  log=out / "diloco-lighthouse.log")
        try:
            if name.startswith(("shardwise/", "fsdp2/")):  # one job over both nodes
                procs = [link.agent(n, b.nproc, args, run_id=f"diloco-{os.getpid()}", env=env,
                                    log=out / f"diloco-{_slug(name)}-node{n}.log") for n in (0, 1)]
            else:  # a job per node
                standalone = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(b.nproc)]
                procs = [link.run(n, [*standalone, *args], env={**env, "SHARDWISE_BENCH_NODE": str(n)},
                                  log=out / f"diloco-{_slug(name)}-node{n}.log") for n in (0, 1)]
            codes = [_wait(p, 1800) for p in procs]
        finally:
            if lighthouse is not None:
                os.killpg(lighthouse.pid, 9)
                lighthouse.wait()
    if any(codes):
        raise SystemExit(f"shardwise bench --diloco: {name} exited with {codes}: see {out}/diloco-{_slug(name)}-node*.log")
    return row_of(out, name)


def row_of(out: Path, name: str) -> dict:
    """System ``name``'s row from its nodes' reports in ``out`` (each counts its own ranks' tokens)."""
    reports = [json.loads(p.read_text()) for p in sorted(out.glob(f"diloco-{_slug(name)}-node*.json"))]
    if sorted(r["node"] for r in reports) != [0, 1]:
        raise SystemExit(f"shardwise bench --diloco: {name} left reports of nodes {[r['node'] for r in reports]}, not 0 and 1")
    link_bytes = next(r["link_bytes"] for r in reports if r["node"] == 0)
    tokens = sum(r["tokens"] for r in reports)
    return {
        "tokens_per_s": sum(r["tokens"] / r["seconds"] for r in reports),
        "link_bytes": link_bytes,
        "link_bytes_per_token": link_bytes / tokens,
        "losses": [sum(v) / len(v) for v in zip(*(r["losses"] for r in reports), strict=True)],  # (the nodes' mean)
    }


def _flags(b: DilocoBench) -> list[str]:
    return [
        "--link", b.link, "--sync-every", str(b.sync_every), "--fragments", str(b.fragments),
        "--fragment-sync-delay", str(b.fragment_sync_delay), "--rounds", str(b.rounds),
        "--exact-steps", str(b.exact_steps), "--model", b.model,
        "--batch-size", str(b.batch_size), "--seq-len", str(b.seq_len), "--out", str(Path(b.out).resolve()),
        "--seed", str(b.seed), "--outer-lr", str(b.outer_lr), "--outer-momentum", str(b.outer_momentum),
        "--warmup-steps", str(b.warmup_steps), "--lr", str(b.lr),
    ]


def _slug(name: str) -> str:
    return name.replace("/", "-").replace("+", "-")


def _wait(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


# --------------------------------------------------------------------------- one rank
def worker(b: DilocoBench, name: str) -> None:
    """One rank of system ``name``: an untimed round, then ``rounds`` timed ones; local rank 0
    of each job writes its node's report (node A's with its veth's bytes)."""
    import torch
    import torch.distributed as dist

    from .. import api
    from ..checkpoint import load, save
    from ..core import groups, wrap
    from .harness import BenchConfig, build_system, device_meshes, workload
    from .optimizers import make_optimizers

    groups.init()
    torch.set_num_threads(1)
    rank, device = dist.get_rank(), groups.device()
    # (torchrun's ranks per node: --nproc cannot reach a worker, torchrun's parser takes it for its own)
    b = replace(b, nproc=int(os.environ["LOCAL_WORLD_SIZE"]))
    across = not (name == "alone" or name.startswith("diloco"))
    node = rank // b.nproc if across else int(os.environ["SHARDWISE_BENCH_NODE"])
    start = b.warmup_steps if name.startswith("diloco") else 0  # (the batch it starts at)
    warmup, steps = (2, b.exact_steps) if across else (start + b.sync_every, b.rounds * b.sync_every)
    ckpt = Path(b.out, f"warmup-{b.warmup_steps}")
    cfg = BenchConfig(model=b.model, batch_size=b.batch_size, seq_len=b.seq_len, warmup=warmup, steps=steps,
                      systems=(name if across else "shardwise/full_shard",), shard_size=b.nproc, seed=b.seed)
    # (both nodes' share of one global batch a step, whether one job or two: the same tokens in every system)
    rows_at = rank if across else node * b.nproc + int(os.environ["LOCAL_RANK"])
    work = workload(cfg, rows_at, 2 * b.nproc, device)
    ft = None
    if across:
        model, opts, _ = build_system(name, cfg, work, device, device_meshes(cfg, device))
        opt = opts[0]
    else:
        torch.manual_seed(cfg.seed)
        model = work.build()
        if name.startswith("diloco"):
            from ..ft import Torchft
            from .netns import ADDRESSES

            ft = Torchft(lighthouse=f"http://{ADDRESSES[0]}:{LIGHTHOUSE_PORT}", replica_id=f"node{node}",
                         min_replicas=2, timeout=300, quorum_timeout=600)
        api.shard(model, wrap=wrap.by_class(work.block), strategy="full_shard", fault_tolerance=ft)
        (inner,) = make_optimizers("shardwise/full_shard", model, work.block, "adamw")
        if start:
            load(ckpt, model, inner)
        comm = name.partition("+")[2]
        outer = partial(torch.optim.SGD, lr=b.outer_lr, momentum=b.outer_momentum, nesterov=b.outer_momentum > 0)
        opt = inner if ft is None else ft.diloco(inner, sync_every=b.sync_every, outer_optimizer=outer,
                                                 comm=None if comm == "fp32" else comm, fragments=b.fragments,
                                                 fragment_sync_delay=b.fragment_sync_delay)
    for group in opt.param_groups:  # (a DiLoCo optimizer's are its inner one's)
        group["lr"] = b.lr
    losses = []
    for step, (x, y) in enumerate(work.batches[start:], start):
        if step == warmup:  # (after the untimed steps: DiLoCo's first round, its sync included)
            dist.barrier()
            t0, counted = time.perf_counter(), _link_bytes()
        opt.zero_grad()
        loss = work.loss(model, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if name == "shardwise/hybrid_shard" and step + 1 == b.warmup_steps:
            save(ckpt, model, opt)
    dist.barrier()
    seconds, sent = time.perf_counter() - t0, _link_bytes() - counted
    if ft is not None:
        ft.shutdown()
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        mine = work.tokens_per_step * steps // 2  # (this node's ranks': half the global batch)
        report = {"node": node, "seconds": seconds, "tokens": mine,
                  "link_bytes": sent, "losses": losses}
        Path(b.out, f"diloco-{_slug(name)}-node{node}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _link_bytes() -> int:
    """Bytes this node's veth (``GLOO_SOCKET_IFNAME``) sent and received so far."""
    stats = Path("/sys/class/net", os.environ["GLOO_SOCKET_IFNAME"], "statistics")
    return sum(int((stats / f).read_text()) for f in ("tx_bytes", "rx_bytes"))


# --------------------------------------------------------------------------- the report
def render(summary: dict) -> str:
    c, rows = summary["config"], summary["rows"]
    alone, exact = rows.get("alone"), rows.get("shardwise/hybrid_shard")
    lines = [
        f"GPT {c['model']}, 2 nodes of {c['nproc']} ranks joined by a {c['link']} link each way, "
        f"{c['batch_size']} x {c['seq_len']} tokens per rank per step; timed: {c['rounds']} rounds of "
        f"{c['sync_every']} steps (DiLoCo's H; alone too; {c['fragments']} fragments, each exchange "
        f"overlapping {c['fragment_sync_delay']} inner steps), {c['exact_steps']} steps of the per-step systems.",
        "",
        "| system | tokens/s | vs alone | link bytes/token | exact hybrid's over this |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        vs_alone = f"{r['tokens_per_s'] / alone['tokens_per_s']:.2f}x" if alone else "-"
        fewer = f"{exact['link_bytes_per_token'] / r['link_bytes_per_token']:.0f}x" if exact and name != "alone" else "-"
        lines.append(f"| {name} | {r['tokens_per_s']:.0f} | {vs_alone} | {r['link_bytes_per_token']:.1f} | {fewer} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
