"""Fault tolerance across a real slow link: two nodes (network namespaces joined by a veth pair
shaped with tc, shardwise.bench.netns) of 2 ranks each, training a GPT.

    python benchmarks/fault_tolerance.py --link 1gbit --out ft-out     # recovery, today, overhead
    python benchmarks/fault_tolerance.py --only overhead --steps 40 --rounds 3   # on a quiet machine
    python benchmarks/fault_tolerance.py --only soak --kills 20

What each part measures (every time is wall-clock, from events the ranks log as they go):

- recovery: each node is a torchrun job of its own, one replica group on shardwise.ft (the
  lighthouse runs on node A, ``shardwise lighthouse``). Once both train together, a rank of node
  B is SIGKILLed; its torchrun restarts it (``--max-restarts``). Reported: seconds from the kill
  to the survivors' next committed step, and to B's first committed step beside A again (B's
  processes up, its heal, then the step), and the bytes each rank of B received to heal
  against the bytes of its shards and optimizer state.
- today: one torchrun job across both nodes (``hybrid_shard``: the nodes are replicas) saving a
  checkpoint every ``--save-every`` steps; the same kill: every rank restarts, reloads the last
  checkpoint and redoes the steps since. Reported: seconds from the kill to the first step after
  the restart and to the step the job had reached, and the steps redone.
- overhead: no failure; shardwise.ft (two jobs, a lighthouse) against the same model as one
  ``hybrid_shard`` job across the link (the same bytes cross it), alternating rounds; the
  median step time of each, and the ratio.
- soak: shardwise.ft with ``--kills`` kills of a random rank of a random node, each once both
  groups train together again. Reported: no hang (a deadline), every run's committed steps
  consecutive (none repeated or skipped), both groups' final shards and optimizer state equal
  rank for rank (hashes).

Needs root and iproute2 (the namespaces), and torchft (``pip install -e '.[ft]'``). Results are
written to ``--out`` as ``fault_tolerance.json`` and ``fault_tolerance.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
LIGHTHOUSE_PORT = 29510


# --------------------------------------------------------------------------- one rank
def worker(cfg: dict) -> None:
    """One rank: shardwise.ft (``mode`` ft: this node's job is a replica group) or one job
    across both nodes (``mode`` plain: hybrid_shard, checkpoints, --resume)."""
    import torch
    import torch.distributed as dist

    import shardwise
    from shardwise.job.data import get_batch, rank_slice
    from shardwise.job.models import GPT, Block, gpt_config

    shardwise.init(timeout=cfg["timeout"])
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    # this process's start in ms names its run: an agent that restarts its workers because
    # another agent's failed does not count a restart, so TORCHELASTIC_RESTART_COUNT repeats
    run = time.time_ns() // 1_000_000
    out, name = Path(cfg["out"]), cfg["name"]
    where = {"pid": os.getpid(), "dev": os.environ.get("GLOO_SOCKET_IFNAME"), "local_rank": int(os.environ["LOCAL_RANK"])}
    (out / f"pid-{name}-r{rank}-run{run}").write_text(json.dumps(where))
    torch.manual_seed(0)
    model = GPT(gpt_config(cfg["model"], seq_len=cfg["seq_len"]))
    ft = None
    if cfg["mode"] == "ft":
        import shardwise.ft

        ft = shardwise.ft.Torchft(lighthouse=os.environ["TORCHFT_LIGHTHOUSE"], replica_id=name, timeout=cfg["timeout"])
        shardwise.shard(model, wrap=shardwise.wrap.by_class(Block), fault_tolerance=ft)
    else:
        shardwise.shard(model, wrap=shardwise.wrap.by_class(Block), strategy="hybrid_shard", shard_size=2)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = ft.optimizer(inner) if ft else inner
    start = _resume(model, inner, cfg) if cfg["mode"] == "plain" else 0
    events = open(out / f"events-{name}-run{run}.jsonl", "w") if rank == 0 else None  # noqa: SIM115
    together, healed, saving, step = 0, None, None, start
    seed = cfg["seed"] + (1000 * (1 + "AB".index(name[-1])) if ft else 0)  # (each group reads its own data)
    rows = cfg["batch"] * world
    while True:
        stop = _stop(out)
        if stop is not None and step >= stop and (ft is None or together >= 3):
            break
        t0 = time.time()
        opt.zero_grad(set_to_none=True)
        t1 = time.time()
        step = ft.step if ft else step
        x, y = get_batch(step, rows, cfg["seq_len"], seed=seed)
        model(rank_slice(x, rank, world), rank_slice(y, rank, world)).backward()
        t2 = time.time()
        opt.step()
        committed = ft.step > step if ft else True
        participants = ft.participants if ft else 2
        together = (together + 1 if participants == 2 else 0) if committed else together
        record = {"t0": t0, "t": time.time(), "step": step, "P": participants, "committed": committed,
                  "zero_grad_s": t1 - t0, "backward_s": t2 - t1}
        if ft and ft.last_heal is not None and healed is None:
            healed = ft.last_heal
            record["heal"] = {"step": healed.step, "bytes": healed.bytes, "seconds": healed.seconds}
        if events:
            events.write(json.dumps(record) + "\n")
            events.flush()
        if committed:
            step += 1
            if cfg["mode"] == "plain" and cfg["save_every"] and step % cfg["save_every"] == 0:
                saving = shardwise.save(out / "ckpt" / f"step-{step:08d}", model, inner, step=step, async_=True)
    if saving is not None:
        saving.wait()
    waits = {k: round(v.wait_seconds, 3) for k, v in shardwise.comm_stats().items() if v.calls}
    final = {"step": step, "hash": _state_hash(model, inner), "shard_bytes": _held(model, inner), "wait_s": waits}
    if healed is not None:
        final["heal"] = {"step": healed.step, "bytes": healed.bytes, "seconds": healed.seconds}
    (out / f"final-{name}-r{rank}.json").write_text(json.dumps(final))
    if ft:
        ft.shutdown()
    dist.destroy_process_group()


def _resume(model, opt, cfg: dict) -> int:
    import shardwise

    path = shardwise.latest(Path(cfg["out"]) / "ckpt")
    return shardwise.load(path, model, opt).step if path is not None else 0


def _stop(out: Path) -> int | None:
    """The step every group stops at (written by the orchestrator), if it has been written."""
    path = out / "stop"
    with contextlib.suppress(FileNotFoundError, ValueError):
        return int(path.read_text())
    return None


def _state_hash(model, opt) -> str:
    """A hash of this rank's shards and optimizer state, by name."""
    import torch

    names = {id(p): n for n, p in model.named_parameters()}
    h = hashlib.sha256()
    for n, p in sorted(model.named_parameters()):
        h.update(n.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    for p, st in sorted(opt.state.items(), key=lambda kv: names[id(kv[0])]):
        for k, v in sorted(st.items()):
            h.update(f"{names[id(p)]}.{k}".encode())
            h.update(v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _held(model, opt) -> int:
    """Bytes of this rank's shards and optimizer state tensors (what a heal must move)."""
    import torch

    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v))


# --------------------------------------------------------------------------- the two nodes
class Nodes:
    """Two namespaces, the lighthouse on node A, and the jobs started on them."""

    def __init__(self, link, out: Path, cfg: argparse.Namespace):
        self.link, self.out, self.cfg = link, out, cfg
        self.procs: list[subprocess.Popen] = []  # the jobs' torchrun agents
        self.lighthouse_proc: subprocess.Popen | None = None
        self.lighthouse = f"http://{link.addresses[0]}:{LIGHTHOUSE_PORT}"

    def env(self) -> dict:
        return {
            "OMP_NUM_THREADS": "1", "TORCHFT_LIGHTHOUSE": self.lighthouse, "RUST_LOG": "warn",
        }

    def start_lighthouse(self) -> None:
        cmd = [sys.executable, "-m", "shardwise", "lighthouse", "--port", str(LIGHTHOUSE_PORT),
               "--bind", self.link.addresses[0]]
        self.lighthouse_proc = self.link.run(0, cmd, log=self.out / "lighthouse.log", env=self.env())
        deadline = time.monotonic() + 60
        while not _reachable_from(self.link, 1, self.lighthouse):
            if time.monotonic() > deadline:
                raise SystemExit(f"the lighthouse did not start: {(self.out / 'lighthouse.log').read_text()[-2000:]}")
            time.sleep(0.2)

    def job(self, mode: str, node: int | None, restarts: int) -> None:
        """ft: node ``node``'s own torchrun job; plain: the agents of one job across both."""
        cfg = self.cfg
        spec = {
            "mode": mode, "out": str(self.out), "model": cfg.model, "seq_len": cfg.seq_len, "batch": cfg.batch_size,
            "seed": 0, "timeout": cfg.timeout, "save_every": cfg.save_every,
        }
        if mode == "ft":
            spec["name"] = f"node{'AB'[node]}"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   "--max-restarts", str(restarts), "--monitor-interval", "0.5", str(HERE), "worker", json.dumps(spec)]
            self.procs.append(self.link.run(node, cmd, log=self.out / f"job-{spec['name']}.log", env=self.env()))
            return
        spec["name"] = "plain"
        run_id = f"ft-bench-{os.getpid()}-{time.time_ns()}"  # (one rendezvous for both agents)
        for n in (0, 1):
            self.procs.append(self.link.agent(
                n, 2, [str(HERE), "worker", json.dumps(spec)], run_id=run_id,
                log=self.out / f"job-plain-{n}.log", env=self.env(), max_restarts=restarts,
            ))

    def events(self, name: str) -> dict[int, list[dict]]:
        """Each run's events of job ``name`` (rank 0's), by run (its start, in ms)."""
        out = {}
        for p in self.out.glob(f"events-{name}-run*.jsonl"):
            out[int(p.stem.rsplit("run", 1)[1])] = [json.loads(line) for line in p.read_text().splitlines() if line]
        return dict(sorted(out.items()))

    def last_step(self, name: str) -> int:
        runs = self.events(name)
        return max((e["step"] for ev in runs.values() for e in ev if e["committed"]), default=-1)

    def wait(self, what, deadline_s: float, why: str) -> None:
        deadline = time.monotonic() + deadline_s
        while not what():
            if time.monotonic() > deadline:
                raise TimeoutError(f"gave up waiting for {why}")
            if all(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"the jobs ended ({[p.returncode for p in self.procs]}) before {why}")
            time.sleep(0.1)

    def runs_after(self, name: str, t: float) -> list[list[dict]]:
        """The runs of job ``name`` that started after time ``t``."""
        return [ev for start, ev in self.events(name).items() if start / 1000 > t]

    def kill(self, name: str, local_rank: int, node: int) -> float:
        """SIGKILL local rank ``local_rank`` of job ``name`` on node ``node`` (its latest run);
        the time of the kill."""
        latest: dict[str, tuple[int, int]] = {}
        for p in self.out.glob(f"pid-{name}-r*-run*"):
            where, run = json.loads(p.read_text()), int(p.name.rsplit("run", 1)[1])
            if where["dev"] == self.link.devices[node] and where["local_rank"] == local_rank:
                latest[p.name] = (run, where["pid"])
        _, pid = max(latest.values())
        t = time.time()
        os.kill(pid, signal.SIGKILL)
        return t

    def stop_at(self, step: int) -> None:
        tmp = self.out / "stop.tmp"
        tmp.write_text(str(step))
        tmp.replace(self.out / "stop")

    def finish(self, deadline_s: float) -> list[int | None]:
        """Wait for the jobs to end; their exit codes (None: still running at the deadline)."""
        end = time.monotonic() + deadline_s
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(1.0, end - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    def close(self) -> None:
        procs = [*self.procs, *([self.lighthouse_proc] if self.lighthouse_proc else [])]
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        # ranks a killed agent left behind (every rank wrote its process id)
        for pid_file in self.out.glob("pid-*"):
            with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
                os.kill(json.loads(pid_file.read_text())["pid"], signal.SIGKILL)


def _reachable_from(link, node: int, address: str) -> bool:
    """Whether ``address`` answers from inside node ``node``'s namespace."""
    host, port = address.rsplit("//", 1)[1].split(":")
    probe = f"import socket; socket.create_connection(({host!r}, {port}), timeout=1).close()"
    done = subprocess.run(["ip", "netns", "exec", link.namespaces[node], sys.executable, "-c", probe],
                          capture_output=True, check=False)
    return done.returncode == 0


# --------------------------------------------------------------------------- the parts
def recovery(nodes: Nodes, warm: int) -> dict:
    nodes.start_lighthouse()
    nodes.job("ft", 0, restarts=0)
    nodes.job("ft", 1, restarts=1)
    nodes.wait(lambda: _together(nodes) >= warm, 600, f"both groups to train {warm} steps together")
    kill_step = nodes.last_step("nodeB")
    t_kill = nodes.kill("nodeB", 1, node=1)
    nodes.wait(lambda: any(e["committed"] and e["P"] == 2 for ev in nodes.runs_after("nodeB", t_kill) for e in ev),
               600, "node B to train beside node A again")
    nodes.stop_at(max(nodes.last_step("nodeA"), nodes.last_step("nodeB")) + 5)
    codes = nodes.finish(600)
    a = [e for ev in nodes.events("nodeA").values() for e in ev]
    b = nodes.runs_after("nodeB", t_kill)[0]
    in_flight = next((e for e in a if e["t"] > t_kill), None)  # the step the kill fell in
    survivors = next(e for e in a if e["committed"] and e["t0"] > t_kill)  # the first begun after it
    back = next(e for e in b if e["committed"] and e["P"] == 2)
    restarted = min(run / 1000 for run in nodes.events("nodeB") if run / 1000 > t_kill)
    finals = {r: json.loads((nodes.out / f"final-nodeB-r{r}.json").read_text()) for r in (0, 1)}
    steady = [e["t"] - e["t0"] for e in a if e["committed"] and e["P"] == 2 and e["step"] < kill_step]
    return {
        "exit_codes": codes,
        "killed_at_step": kill_step,
        "survivors_next_commit_s": survivors["t"] - t_kill,
        "step_in_flight_committed": bool(in_flight and in_flight["committed"] and in_flight["t0"] < t_kill),
        "survivors_failed_attempts": sum(1 for e in a if not e["committed"] and e["t0"] > t_kill - 5),
        "alone_steps": sum(1 for e in a if e["committed"] and e["P"] == 1 and e["t"] > t_kill),
        "restarted_processes_s": restarted - t_kill,
        "heal_s": [finals[r]["heal"]["seconds"] for r in (0, 1)],
        "back_beside_s": back["t"] - t_kill,
        "heal_bytes": [finals[r]["heal"]["bytes"] for r in (0, 1)],
        "shard_bytes": [finals[r]["shard_bytes"] for r in (0, 1)],
        "step_s": statistics.median(steady) if steady else None,
        "equal": _equal_groups(nodes),
    }


def today(nodes: Nodes, warm: int) -> dict:
    save_every = nodes.cfg.save_every
    nodes.job("plain", None, restarts=1)
    import shardwise

    # killed half-way between two checkpoints: on average that many steps are redone
    kill_at = max(warm, save_every + save_every // 2) if save_every else warm
    nodes.wait(lambda: nodes.last_step("plain") >= kill_at and shardwise.latest(nodes.out / "ckpt"), 600,
               f"{kill_at} steps and a checkpoint")
    reached = nodes.last_step("plain")
    t_kill = nodes.kill("plain", 1, node=1)
    nodes.wait(lambda: any(e["step"] > reached + 1 for ev in nodes.runs_after("plain", t_kill) for e in ev), 900,
               "the job to come back past the step it had reached")
    nodes.stop_at(nodes.last_step("plain") + 3)
    codes = nodes.finish(600)
    after = nodes.runs_after("plain", t_kill)[0]
    first = after[0]
    caught_up = next(e for e in after if e["step"] > reached)
    steady = [e["t"] - e["t0"] for e in next(iter(nodes.events("plain").values()))[2:]]
    return {
        "exit_codes": codes,
        "killed_at_step": reached,
        "resumed_at_step": first["step"],
        "first_step_after_restart_s": first["t"] - t_kill,
        "back_at_reached_step_s": caught_up["t"] - t_kill,
        "steps_redone": reached + 1 - first["step"],
        "save_every": save_every,
        "step_s": statistics.median(steady) if steady else None,
    }


def overhead(nodes_for, rounds: int, steps: int, warmup: int) -> dict:
    """Alternating rounds of shardwise.ft and of one hybrid job, in fresh namespaces each."""
    times: dict[str, list[float]] = {"ft": [], "plain": []}
    for r in range(rounds):
        for mode in ("ft", "plain") if r % 2 == 0 else ("plain", "ft"):
            with nodes_for(f"overhead-{mode}-{r}") as nodes:
                nodes.stop_at(warmup + steps)
                if mode == "ft":
                    nodes.start_lighthouse()
                    nodes.job("ft", 0, restarts=0)
                    nodes.job("ft", 1, restarts=0)
                else:
                    nodes.job("plain", None, restarts=0)
                codes = nodes.finish(1800)
                if any(codes):
                    raise SystemExit(f"overhead round {r} ({mode}): exit codes {codes}")
                name = "nodeA" if mode == "ft" else "plain"
                ev = [e for run in nodes.events(name).values() for e in run]
                ev = [e for e in ev if e["committed"] and e["step"] >= warmup and e["P"] == 2]
                times[mode] += [e["t"] - e["t0"] for e in ev]
    ft, plain = statistics.median(times["ft"]), statistics.median(times["plain"])
    return {"ft_step_s": ft, "plain_step_s": plain, "ratio": ft / plain, "steps_each": {k: len(v) for k, v in times.items()}}


def soak(nodes: Nodes, kills: int, seed: int) -> dict:
    rng = random.Random(seed)
    nodes.start_lighthouse()
    nodes.job("ft", 0, restarts=kills)
    nodes.job("ft", 1, restarts=kills)
    done = []
    for _ in range(kills):
        nodes.wait(lambda: _together(nodes, since=done[-1]["t"] if done else 0) >= 2, 900, "both groups together")
        time.sleep(rng.uniform(0.0, 3.0))
        node, rank = rng.choice([0, 1]), rng.choice([0, 1])
        done.append({"node": node, "rank": rank, "t": nodes.kill(f"node{'AB'[node]}", rank, node=node)})
    nodes.wait(lambda: _together(nodes, since=done[-1]["t"]) >= 2, 900, "both groups together after the last kill")
    nodes.stop_at(max(nodes.last_step("nodeA"), nodes.last_step("nodeB")) + 5)
    codes = nodes.finish(900)
    runs = {f"{name}-run{run}": ev for name in ("nodeA", "nodeB") for run, ev in nodes.events(name).items()}
    gaps = {k: _gaps(ev) for k, ev in runs.items()}
    return {
        "kills": len(done),
        "exit_codes": codes,
        "runs": len(runs),
        "committed_steps": max(nodes.last_step("nodeA"), nodes.last_step("nodeB")) + 1,
        "repeated_or_skipped": {k: g for k, g in gaps.items() if g},
        "equal": _equal_groups(nodes),
    }


def _together(nodes: Nodes, since: float = 0) -> int:
    """Steps both groups committed in a quorum of 2 after time ``since`` (node A's count)."""
    return sum(
        1 for ev in nodes.events("nodeA").values() for e in ev if e["committed"] and e["P"] == 2 and e["t"] > since
    )


def _gaps(events: list[dict]) -> list:
    """Where a run's committed steps do not follow each other, or a failed step was not retried."""
    out = []
    for e, nxt in itertools.pairwise(events):
        want = e["step"] + 1 if e["committed"] else e["step"]
        if nxt["step"] != want:
            out.append((e["step"], e["committed"], nxt["step"]))
    return out


def _equal_groups(nodes: Nodes) -> bool:
    finals = {(n, r): json.loads((nodes.out / f"final-node{n}-r{r}.json").read_text()) for n in "AB" for r in (0, 1)}
    return all(finals["A", r]["hash"] == finals["B", r]["hash"] and finals["A", r]["step"] == finals["B", r]["step"]
               for r in (0, 1))


# --------------------------------------------------------------------------- the report
def markdown(results: dict, cfg: argparse.Namespace) -> str:
    lines = [f"Two nodes x 2 ranks, GPT {cfg.model} ({cfg.batch_size} x {cfg.seq_len} tokens per rank), link {cfg.link}.", ""]
    rec, old = results.get("recovery"), results.get("today")
    if rec or old:
        lines += ["| | shardwise.ft (lost node dropped, healed from a live one) | today (restart all + checkpoint) |",
                  "| --- | --- | --- |"]

        def cell(r, key, fmt="{:.1f} s"):
            return fmt.format(r[key]) if r and r.get(key) is not None else "-"

        lines += [
            f"| step time before the kill | {cell(rec, 'step_s', '{:.2f} s')} | {cell(old, 'step_s', '{:.2f} s')} |",
            f"| kill -> survivors' next committed step (begun after the kill) | {cell(rec, 'survivors_next_commit_s')} | "
            f"{cell(old, 'first_step_after_restart_s')} (after every rank restarted and reloaded) |",
            f"| kill -> the lost node contributes again | {cell(rec, 'back_beside_s')} | {cell(old, 'back_at_reached_step_s')} "
            "(back at the step reached) |",
            f"| steps redone | 0 | {old['steps_redone'] if old else '-'} (checkpoint every {cfg.save_every}) |",
        ]
        if rec:
            lines += [
                f"| restarted processes up | {rec['restarted_processes_s']:.1f} s after the kill | |",
                f"| heal: time per rank | {', '.join(f'{s:.2f} s' for s in rec['heal_s'])} | |",
                f"| heal: bytes per rank (its shards + optimizer state) | "
                f"{', '.join(f'{b / 2**20:.2f} MiB' for b in rec['heal_bytes'])} "
                f"({', '.join(f'{b / 2**20:.2f}' for b in rec['shard_bytes'])} MiB held) | |",
                f"| survivors alone | {rec['alone_steps']} committed steps, {rec['survivors_failed_attempts']} failed "
                f"attempts (the step the kill fell in {'committed' if rec['step_in_flight_committed'] else 'failed'}) | |",
                f"| groups bitwise equal at the end | {rec['equal']} | |",
            ]
    if "overhead" in results:
        o = results["overhead"]
        lines += ["", f"Per step without failures: shardwise.ft {o['ft_step_s']:.3f} s, one hybrid_shard job "
                  f"{o['plain_step_s']:.3f} s: ratio {o['ratio']:.3f} (median of {o['steps_each']} steps)."]
    if "soak" in results:
        s = results["soak"]
        lines += ["", f"Soak: {s['kills']} kills, {s['runs']} runs, {s['committed_steps']} committed steps, exit codes "
                  f"{s['exit_codes']}; repeated or skipped steps: {s['repeated_or_skipped'] or 'none'}; groups bitwise "
                  f"equal at the end: {s['equal']}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "worker":
        worker(json.loads(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("recovery", "today", "overhead", "soak"), action="append",
                   help="parts to run (default: recovery, today and overhead)")
    p.add_argument("--link", default="1gbit", help="the link's rate each way (tc units)")
    p.add_argument("--model", default="small", choices=("tiny", "small", "medium"))
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--save-every", type=int, default=10, help="today: steps between checkpoints")
    p.add_argument("--timeout", type=float, default=30.0, help="collective timeout (both ways)")
    p.add_argument("--warm", type=int, default=8, help="steps trained together before the kill")
    p.add_argument("--steps", type=int, default=20, help="overhead: timed steps per round")
    p.add_argument("--warmup", type=int, default=5, help="overhead: steps not timed")
    p.add_argument("--rounds", type=int, default=2, help="overhead: rounds of each")
    p.add_argument("--kills", type=int, default=20, help="soak: kills")
    p.add_argument("--seed", type=int, default=0, help="soak: which ranks die when")
    p.add_argument("--out", default="ft-out")
    cfg = p.parse_args(argv)
    from shardwise.bench.netns import two_nodes, unavailable

    why = unavailable()
    if why:
        raise SystemExit(f"fault_tolerance.py needs two network namespaces: {why}")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def nodes_for(part: str):
        where = out / part
        if where.exists():
            subprocess.run(["rm", "-rf", str(where)], check=True)
        where.mkdir(parents=True)
        with two_nodes(rate=cfg.link) as link:
            nodes = Nodes(link, where, cfg)
            try:
                yield nodes
            finally:
                nodes.close()

    results: dict = {"config": vars(cfg)}
    parts = cfg.only or ["recovery", "today", "overhead"]
    for part in parts:
        t0 = time.monotonic()
        if part == "overhead":
            results[part] = overhead(nodes_for, cfg.rounds, cfg.steps, cfg.warmup)
        else:
            with nodes_for(part) as nodes:
                results[part] = {"recovery": recovery, "today": today, "soak": soak}[part](
                    nodes, *((cfg.kills, cfg.seed) if part == "soak" else (cfg.warm,))
                )
        results[part]["wall_s"] = time.monotonic() - t0
        print(json.dumps({part: results[part]}, indent=1), flush=True)
    (out / "fault_tolerance.json").write_text(json.dumps(results, indent=1))
    table = markdown(results, cfg)
    (out / "fault_tolerance.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
