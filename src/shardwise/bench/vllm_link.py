"""``shardwise bench --vllm --nodes 2``: the engine on another node, across a shaped link.

Two network namespaces joined by a veth pair shaped to ``--link`` (``shardwise.bench.netns``):
node B runs ``vllm serve`` with the "shardwise" weight-transfer backend and a TCP sink (the
link probe); node A runs the trainer ranks under torchrun, which push over the tcp transport
(``VLLMSync(model, url, transport="tcp", address=<A>)``). The floor is then the bytes over
the link's bandwidth, measured by rank 0 in the same run across the same veth.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from .netns import ADDRESSES

# the engine's KV cache: vLLM on CPU otherwise reserves 92% of the machine's memory and refuses
# to start when other processes hold more than 8%
KV_CACHE_BYTES = 1 << 30
SERVE_TIMEOUT_S = 900.0  # a first `vllm serve` on a busy 2-core machine takes minutes
# How long a stopped engine may take to shut down. vLLM's default for a server, 0, kills the
# engine core at once (an in-process LLM's, 5 s, under load), before it unlinks its shared
# memory: Python's resource tracker then warns of leaked shared_memory objects at exit, and
# removes them itself. The engine core waits 5 s for its worker, then 4 more after a SIGTERM.
SHUTDOWN_TIMEOUT_S = 15


def engine_url(port: int) -> str:
    """The ``vllm serve`` on node B, as node A reaches it."""
    return f"http://{ADDRESSES[1]}:{port}"


def serve_command(model_dir: Path, port: int, host: str = ADDRESSES[1]) -> list[str]:
    """``vllm serve`` (its OpenAI server module) on ``host`` (node B's address), bf16 (the
    wire's dtype), with the weight-transfer backend and the in-process engine's settings
    (``vllm_push``)."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--host", host, "--port", str(port), "--skip-tokenizer-init", "--dtype", "bfloat16",
        "--max-model-len", "128", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--enforce-eager",
        "--enable-scale-out", "--max-num-seqs", "8", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
        "--weight-transfer-config", '{"backend": "shardwise"}',
    ]


def wait_healthy(url: str, timeout: float = SERVE_TIMEOUT_S, check: Callable[[], None] | None = None) -> None:
    """Hold until the ``vllm serve`` at ``url`` answers ``/health``; ``check`` runs between
    polls and raises where the caller sees the server exit (rank 0 here: the parent stops the
    job if the server exits first)."""
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check is not None:
            check()
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer /health within {timeout:.0f} s")


def run(model, cfg, argv: list[str]) -> None:
    """The parent: namespaces, the engine and the sink on node B, the trainer job on node A;
    every process stopped and both namespaces deleted at the end, whatever happened."""
    from .netns import two_nodes, unavailable, without_nproc

    why = unavailable()
    if why:
        raise SystemExit(f"shardwise bench --vllm --nodes 2: {why}")
    work = Path(tempfile.mkdtemp(prefix="shardwise-bench-vllm-link-"))
    model.save_pretrained(work / "start")
    threads = {"OMP_NUM_THREADS": str(cfg.threads)}
    serve_env = {**threads, "VLLM_SERVER_DEV_MODE": "1"}
    trainer = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(cfg.nproc),
        "-m", "shardwise", "bench", "--vllm", *without_nproc(argv),
    ]
    code = 0
    try:
        with two_nodes(rate=cfg.link) as link:
            procs: list[subprocess.Popen] = []
            try:
                sink = f"from shardwise.bench.netns import sink; sink({cfg.port + 1})"
                procs.append(link.run(1, [sys.executable, "-c", sink], log=work / "sink.log", session=True))
                procs.append(link.run(1, serve_command(work / "start", cfg.port), log=work / "serve.log",
                                      env=serve_env, session=True))
                procs.append(link.run(0, trainer, env=threads, session=True))
                code = wait_for_trainer(procs[-1], procs[:-1], work)
            finally:
                for p in reversed(procs):
                    stop_process(p)
    finally:
        if not code:  # kept where the trainer failed: the engine's log
            shutil.rmtree(work, ignore_errors=True)
    if code:
        raise SystemExit(f"shardwise bench --vllm --nodes 2: the trainer job exited {code} (the engine's log: {work})")

def wait_for_trainer(trainer: subprocess.Popen, servers: list[subprocess.Popen], work: Path) -> int:
    """The trainer job's exit code; a server that exits first ends the run with its log."""
    while trainer.poll() is None:
        for s in servers:
            if s.poll() is not None:
                logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in work.glob("*.log"))
                raise SystemExit(f"shardwise bench --vllm --nodes 2: a server on node B exited {s.returncode}:\n{logs}")
        time.sleep(1)
    return trainer.returncode


def stop_process(proc: subprocess.Popen) -> None:
    """Stop a process started in a session of its own and its children: SIGTERM to it alone
    (a server shuts its engine down, which then releases its shared memory; a SIGTERM to the
    whole session would reach the engine's processes mid-shutdown), then SIGKILL to whatever
    of the session is left."""
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(SHUTDOWN_TIMEOUT_S + 10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)

