"""``shardwise bench --vllm --engines K``: one push into several engines against the same push
into one of them, in one run.

    shardwise bench --vllm --engines 3 --nproc 2 --size medium

The parent starts K ``vllm serve`` on this machine (bf16, the "shardwise" weight-transfer
backend, ports ``--port`` + k), waits until each answers, then runs the trainer ranks under
torchrun. They push (shared memory) to the first engine alone, then to the first two, ... up
to K: per count, the median push (the slowest rank's) and the engines' pause (from
``start_weight_update`` to the end of ``finish_weight_update``, the longest), and the push's
ratio to one engine's (target <= 1.3x: each engine is fed by a rank of its own). Rank 0 also
books the CPU the engines (each server's session: its API server, engine core and worker)
and the whole machine spent in each push, so that a push slowed by engines queueing for too
few cores shows as such. Writes ``bench_vllm_engines.json`` and ``bench_vllm_engines.md`` in
``--out``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

HOST = "127.0.0.1"
ENGINE_PIDS = "SHARDWISE_BENCH_ENGINE_PIDS"  # the servers' pids (each its session's id), for rank 0


def engine_urls(cfg) -> list[str]:
    return [f"http://{HOST}:{cfg.port + k}" for k in range(cfg.engines)]


def run(model, cfg, argv: list[str]) -> None:
    """The parent: the engines, then the trainer job; every server stopped at the end."""
    from .netns import without_nproc
    from .vllm_link import serve_command, stop_process, wait_for_trainer, wait_healthy

    work = Path(tempfile.mkdtemp(prefix="shardwise-bench-vllm-engines-"))
    model.save_pretrained(work / "start")
    threads = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads)}
    servers: list[subprocess.Popen] = []
    code = 0
    try:
        cores = sorted(os.sched_getaffinity(0))
        for k in range(cfg.engines):
            # each engine's kernels on a core of its own where there are enough (vLLM's automatic
            # binding puts every engine on this machine on the same cores)
            bind = {"VLLM_CPU_OMP_THREADS_BIND": str(cores[k % len(cores)])}
            with open(work / f"serve-{k}.log", "ab") as log:
                servers.append(subprocess.Popen(
                    serve_command(work / "start", cfg.port + k, host=HOST), stdout=log, stderr=subprocess.STDOUT,
                    env={**threads, **bind, "VLLM_SERVER_DEV_MODE": "1"}, start_new_session=True,
                ))
        for server, url in zip(servers, engine_urls(cfg)):
            wait_healthy(url, check=lambda s=server: _exited(s, work))
        threads[ENGINE_PIDS] = ",".join(str(s.pid) for s in servers)
        trainer = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(cfg.nproc),
                   "-m", "shardwise", "bench", "--vllm", *without_nproc(argv)]
        code = wait_for_trainer(subprocess.Popen(trainer, env=threads, start_new_session=True), servers, work)
    finally:
        for s in reversed(servers):
            stop_process(s)
        if not code:  # kept where the trainer failed: the engines' logs
            shutil.rmtree(work, ignore_errors=True)
    if code:
        raise SystemExit(f"shardwise bench --vllm --engines: the trainer job exited {code} (the engines' logs: {work})")


def _exited(server: subprocess.Popen, work: Path) -> None:
    if server.poll() is not None:
        logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in work.glob("*.log"))
        raise SystemExit(f"shardwise bench --vllm --engines: a vllm serve exited {server.returncode}:\n{logs}")


def run_rank(cfg) -> dict:
    """Every rank: the model sharded, then the pushes to 1, 2, ... K engines."""
    import shardwise
    import shardwise.rl

    from .vllm_link import SERVE_TIMEOUT_S
    from .vllm_push import build_model, say, slowest

    shardwise.init(timeout=SERVE_TIMEOUT_S)
    model = build_model(cfg)
    out = {"world": dist.get_world_size(), "size": cfg.size, "params": sum(p.numel() for p in model.parameters()),
           "runs": []}
    shardwise.shard(model, wrap=shardwise.wrap.auto(model))
    urls = engine_urls(cfg)
    sessions = [int(p) for p in os.environ.get(ENGINE_PIDS, "").split(",") if p]
    for k in range(1, cfg.engines + 1):
        say(f"pushing to {k} engine(s)")
        engines = (urls[0] if k == 1 else urls[:k]) if dist.get_rank() == 0 else None
        sync = shardwise.rl.VLLMSync(model, engines, bucket_bytes=cfg.bucket_mb << 20)
        sync.push()  # warm: staging pages resident, engine buffers allocated
        times, pauses, engine_cpu, machine_cpu = [], [], [], []
        for _ in range(cfg.pushes):
            dist.barrier()
            cpu0 = _cpu_seconds(sessions[:k])
            t0 = time.perf_counter()
            sync.push()
            wall = time.perf_counter() - t0
            cpu1 = _cpu_seconds(sessions[:k])
            times.append(slowest(wall))
            pauses.append(slowest(sync.pause_seconds))
            engine_cpu.append(cpu1[0] - cpu0[0])
            machine_cpu.append(cpu1[1] - cpu0[1])
        sync.close()
        out["runs"].append({"engines": k, "seconds": statistics.median(times), "all_seconds": times,
                            "pause_seconds": statistics.median(pauses), "wire_bytes": _wire_bytes(sync),
                            "engine_cpu_seconds": statistics.median(engine_cpu),
                            "machine_cpu_seconds": statistics.median(machine_cpu)})
    out["cores"] = os.cpu_count()
    return out


def _cpu_seconds(sessions: list[int]) -> tuple[float, float]:
    """CPU seconds spent so far by the live processes of these sessions (the engines), and by
    the whole machine (busy: not idle, not waiting on I/O), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    engines = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[3]) in sessions:  # fields from the state on: session, then utime and stime
            engines += int(fields[11]) + int(fields[12])
    with open("/proc/stat") as f:
        times = [int(v) for v in f.readline().split()[1:]]
    return engines / tick, (sum(times) - times[3] - times[4]) / tick


def _wire_bytes(sync) -> int:
    return sum(e.nbytes for e in sync.source.exports)


def report(cfg, r: dict) -> None:
    """The table (printed, ``bench_vllm_engines.md``) and every number (``.json``)."""
    from .vllm_push import vllm_version, write_report

    one = r["runs"][0]["seconds"]
    lines = [
        f"# shardwise bench --vllm --engines {cfg.engines}: {r['size']} Llama ({r['params'] / 1e6:.1f}M parameters, "
        f"{r['runs'][0]['wire_bytes'] / 2**20:.1f} MiB in bf16), {r['world']} trainer ranks, `vllm serve` "
        f"{vllm_version()} engines on CPU, shm",
        "",
        "| engines | push s | x one engine | engine pause s | engines' CPU s | machine's CPU s | cores busy |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in r["runs"]:
        lines.append(f"| {run['engines']} | {run['seconds']:.3f} | {run['seconds'] / one:.2f} | "
                     f"{run['pause_seconds']:.3f} | {run['engine_cpu_seconds']:.2f} | {run['machine_cpu_seconds']:.2f} | "
                     f"{run['machine_cpu_seconds'] / run['seconds']:.2f} of {r['cores']} |")
    worst = max(run["seconds"] / one for run in r["runs"])
    lines += ["", f"- target: a push to several engines <= 1.3x one engine's: {worst:.2f} (median of {cfg.pushes})",
              "- CPU per push (medians): the engines' (every process of each server), the machine's (every "
              "process, other jobs included); cores busy = the machine's CPU seconds over the push's wall time"]
    write_report(cfg, r, lines, "bench_vllm_engines")

