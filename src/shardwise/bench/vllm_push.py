"""``shardwise bench --vllm``: weights into a running vLLM engine, three ways, in one run.

    shardwise bench --vllm --nproc 2 --size small
    shardwise bench --vllm --nproc 4 --size large --pushes 5 --out bench-vllm
    shardwise bench --vllm --nodes 2 --link 1gbit --size medium    # the engine across a link
    shardwise bench --vllm --engines 3 --size medium                # several engines (vllm_engines)

Every rank trains a transformers Llama sharded by shardwise; rank 0 runs a ``vllm.LLM`` (CPU
here, bf16) that loaded the same model. Measured, in this order, on the same engine:

- ``shardwise``: ``VLLMSync.push()`` (bf16 on the wire, shared memory): units gathered one at
  a time and streamed in buckets while the engine loads the previous one.
- ``naive``: verl's way: ``full_state_dict`` on rank 0, written as safetensors (to /dev/shm),
  then vLLM's ``reload_weights`` from that directory.
- ``floor``: the bytes the engine must get (the bf16 model) divided by the machine's copy
  bandwidth (one ``torch`` copy of a buffer as large as the model, bf16 to bf16): no push can
  move them with fewer copies.
- ``delta``: after a full push, AdamW steps at ``--lr`` and a delta push after each: the bytes
  sent against a full push's.
- ``overlap``: AdamW steps alone and each with a full ``push(wait=False)`` streaming beside
  it, alternating: the median step time of each, and how long the push went on after its step.

With ``--nodes 2`` (``vllm_link``) the engine is a ``vllm serve`` on another node joined by a
link shaped to ``--link``, the push goes over the tcp transport, the floor is the bytes over
the link's bandwidth (a plain TCP transfer across the same link, in the same run) and the
naive way is not measured (it needs a filesystem both nodes share).

Time is the median push (the slowest rank's); the engine's pause the median time from
``start_weight_update`` to the end of ``finish_weight_update`` (a server serves nothing in
it; ``VLLMSync.pause_seconds``); extra memory is each rank's peak resident set
during a push above what it held before the first (sampled every millisecond: staging
buffers, gathered units, the naive way's state dict), the largest over ranks. Targets (issue
31): push <= 1.5x the floor and <= 0.5x naive; extra memory <= one bucket + the largest unit;
delta bytes <= 0.1x full at lr 1e-5; (issue 39) a delta push's pause <= 0.1x a full push
across a 100 Mbit/s link, a step with a push beside it <= 1.15x a step alone. Writes ``bench_vllm.json`` and ``bench_vllm.md`` in
``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .netns import link_rate
from .vllm_link import KV_CACHE_BYTES, SERVE_TIMEOUT_S, SHUTDOWN_TIMEOUT_S, engine_url, wait_healthy

SIZES = {  # hidden, intermediate, layers, heads (head_dim 64 but small: 32), vocab
    "small": (256, 704, 4, 8, 8192),
    "medium": (512, 1408, 8, 8, 16384),
    "large": (1024, 2816, 12, 16, 32000),
}

@dataclass
class Config:
    nproc: int = 2
    size: str = "small"
    pushes: int = 5
    naive_pushes: int = 3
    delta_pushes: int = 5
    warmup_steps: int = 10  # AdamW steps before the delta pushes are measured
    lr: float = 1e-5
    bucket_mb: int = 64
    threads: int = 1
    out: str = "bench-vllm"
    seed: int = 0
    nodes: int = 1
    link: str = "1gbit"
    port: int = 18600  # --nodes 2: the engine's port on node B; the link probe's is port + 1
    engines: int = 1  # > 1: that many `vllm serve` here, one push into all against one into one


def parse_args(argv: list[str]) -> Config:
    d = Config()
    p = argparse.ArgumentParser(prog="shardwise bench --vllm", description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=d.nproc, help="trainer ranks (ignored under torchrun)")
    p.add_argument("--size", choices=SIZES, default=d.size, help="the Llama: small ~7M, medium ~42M, large ~220M parameters")
    p.add_argument("--pushes", type=int, default=d.pushes, help="timed shardwise pushes")
    p.add_argument("--naive-pushes", type=int, default=d.naive_pushes, help="timed naive pushes")
    p.add_argument("--delta-pushes", type=int, default=d.delta_pushes, help="delta pushes, one AdamW step before each")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="AdamW steps before the delta pushes")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW's learning rate for the delta pushes")
    p.add_argument("--bucket-mb", type=int, default=d.bucket_mb, help="VLLMSync's staging memory (MiB)")
    p.add_argument("--threads", type=int, default=d.threads, help="intra-op threads per rank")
    p.add_argument("--out", default=d.out, help="output directory")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--nodes", type=int, choices=(1, 2), default=d.nodes,
                   help="2: the engine on a second node (network namespace) across a shaped link (needs root)")
    p.add_argument("--link", type=link_rate, default=d.link, help="--nodes 2: the link's rate each way, in tc's units (1gbit, 100mbit)")
    p.add_argument("--port", type=int, default=d.port, help="--nodes 2: the engine's port on node B (the link probe: port + 1)")
    p.add_argument("--engines", type=int, choices=(1, 2, 3), default=d.engines,
                   help="2 or 3: that many `vllm serve` on this machine (ports --port + k); push time and engine "
                        "pause into 1, 2, ... of them (vllm_engines)")
    cfg = Config(**vars(p.parse_args(argv)))
    if cfg.engines > 1 and cfg.nodes > 1:
        p.error("--engines runs its engines on this machine: give it without --nodes 2")
    return cfg


def build_model(cfg: Config):
    """The Llama every rank and the engine start from (the same seed, the same weights)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    return AutoModelForCausalLM.from_config(model_config(cfg.size))


def model_config(size: str):
    from transformers import LlamaConfig

    hidden, inter, layers, heads, vocab = SIZES[size]
    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads // 2, head_dim=hidden // heads,
        max_position_embeddings=128, tie_word_embeddings=False,
    )


class PeakRss:
    """This process's peak resident set while inside, sampled every millisecond (Linux)."""

    def __enter__(self):
        self.peak, self.stop = _rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _largest(nbytes: int) -> int:
    t = torch.tensor([nbytes], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def copy_bandwidth(nbytes: int) -> float:
    """Bytes per second of one bf16 -> bf16 copy as large as the model (best of 5)."""
    src = torch.ones(max(nbytes // 2, 1), dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return src.numel() * 2 / best


def run_rank(cfg: Config) -> dict:
    import shardwise

    from ..core.groups import DEFAULT_TIMEOUT_S
    from ..rl.source import exports

    shardwise.init(timeout=SERVE_TIMEOUT_S if cfg.nodes == 2 else DEFAULT_TIMEOUT_S)
    rank = dist.get_rank()
    model = build_model(cfg)
    work = Path(tempfile.mkdtemp(prefix="shardwise-bench-vllm-", dir="/dev/shm"))
    engine = None
    try:
        engine = _engine(cfg, model, work) if rank == 0 else None
        dist.barrier()
        shardwise.shard(model, wrap=shardwise.wrap.auto(model))
        _load_vllm_trainer_side()
        base = _rss()
        out = {"world": dist.get_world_size(), "size": cfg.size}
        exps = exports(model, torch.bfloat16)
        out["params"] = sum(e.numel for e in exps)
        out["wire_bytes"] = sum(e.nbytes for e in exps)
        out["largest_unit_bytes"] = _largest_unit(model)
        out["bucket_bytes"] = cfg.bucket_mb << 20
        out["floor_bytes_per_s"] = _floor_bandwidth(cfg, out["wire_bytes"]) if rank == 0 else 0.0
        ways = (("shardwise", _measure_pushes), ("naive", _measure_naive), ("delta", _measure_delta),
                ("overlap", _measure_overlap))
        for way, measure in ways if cfg.nodes == 1 else ways[:1] + ways[2:]:
            say(f"measuring {way}")
            out[way] = measure(model, engine, cfg, base, work)
        return out
    finally:
        if engine is not None and not isinstance(engine, str):  # an LLM's engine is a child this process would wait for at exit
            engine.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
        shutil.rmtree(work, ignore_errors=True)


def _load_vllm_trainer_side() -> None:
    """The vLLM modules a ``VLLMSync`` loads on first use (about 130 MiB resident), loaded
    before the baseline: they are not a push's memory. (Rank 0's in-process ``LLM`` loads them
    anyway; a rank pushing to a server, and the other ranks, would count them.)"""
    import vllm.distributed.utils
    import vllm.distributed.weight_transfer  # noqa: F401

    import shardwise.rl.sync  # noqa: F401


def _engine(cfg: Config, model, work: Path):
    """Rank 0's engine: an in-process ``vllm.LLM`` on this machine, or (``--nodes 2``) the
    URL of the ``vllm serve`` on node B once it answers."""
    if cfg.nodes == 2:
        say("waiting for the engine on node B")
        url = engine_url(cfg.port)
        wait_healthy(url)
        return url
    model.save_pretrained(work / "start")
    say("starting the engine")
    from vllm import LLM

    return LLM(model=str(work / "start"), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128,
               enforce_eager=True, kv_cache_memory_bytes=KV_CACHE_BYTES, weight_transfer_config={"backend": "shardwise"})


def _floor_bandwidth(cfg: Config, nbytes: int) -> float:
    """Bytes per second that bound any push: the machine's copy bandwidth, or across a link
    what a plain TCP transfer of as many bytes gets through it (node A to node B)."""
    if cfg.nodes == 1:
        return copy_bandwidth(nbytes)
    from .netns import ADDRESSES, send_rate

    say("measuring the link")
    return send_rate(ADDRESSES[1], cfg.port + 1, nbytes)


def _sync(model, engine, cfg: Config, **kw):
    """``VLLMSync`` as this run pushes: shared memory, or tcp from node A's address."""
    import shardwise.rl

    if cfg.nodes == 2:
        from .netns import ADDRESSES

        kw.update(transport="tcp", address=ADDRESSES[0])
    return shardwise.rl.VLLMSync(model, engine, bucket_bytes=cfg.bucket_mb << 20, **kw)


def _largest_unit(model) -> int:
    """Bytes of the largest unit's full parameters, in their dtype (what one gather holds)."""
    from ..core.runtime import runtime_of

    rt = runtime_of(model)
    return max(sum(s.numel for s in u.layout.slots) * u.flat_shard.element_size()
               if hasattr(u, "layout") else sum(p.numel() * p.element_size() for p in u.params)
               for u in rt.units)


def say(what: str) -> None:
    if dist.get_rank() == 0:
        print(f"[bench --vllm {time.strftime('%H:%M:%S')}] {what}", flush=True)


def _measure_pushes(model, llm, cfg: Config, base: int, work: Path) -> dict:
    import shardwise

    sync = _sync(model, llm, cfg)
    sync.push()  # warm: staging pages resident, engine buffers allocated
    waited = shardwise.comm_stats()["weight_sync"].wait_seconds
    times, pauses, peak = [], [], 0
    for _ in range(cfg.pushes):
        dist.barrier()
        with PeakRss() as mem:
            t0 = time.perf_counter()
            sync.push()
            times.append(slowest(time.perf_counter() - t0))
        pauses.append(slowest(sync.pause_seconds))
        peak = max(peak, mem.peak - base)
    sync.close()
    engine = (shardwise.comm_stats()["weight_sync"].wait_seconds - waited) / cfg.pushes
    return {"seconds": statistics.median(times), "all_seconds": times, "extra_bytes": _largest(peak),
            "engine_wait_seconds": engine, "pause_seconds": statistics.median(pauses)}


def _measure_naive(model, llm, cfg: Config, base: int, work: Path) -> dict:
    from safetensors.torch import save_file

    import shardwise

    times, peak = [], 0
    for i in range(cfg.naive_pushes):
        dist.barrier()
        with PeakRss() as mem:
            t0 = time.perf_counter()
            full = shardwise.full_state_dict(model)  # every weight on rank 0, fp32
            if dist.get_rank() == 0:
                path = work / f"naive-{i}"
                path.mkdir()
                save_file({k: v.to(torch.bfloat16).contiguous() for k, v in full.items()}, path / "model.safetensors")
                llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
            del full
            dist.barrier()
            times.append(slowest(time.perf_counter() - t0))
        peak = max(peak, mem.peak - base)
        if dist.get_rank() == 0:
            shutil.rmtree(work / f"naive-{i}", ignore_errors=True)
    return {"seconds": statistics.median(times), "all_seconds": times, "extra_bytes": _largest(peak)}


def _measure_delta(model, llm, cfg: Config, base: int, work: Path) -> dict:
    import shardwise

    step = _stepper(model, cfg)
    for _ in range(cfg.warmup_steps):
        step()
    sync = _sync(model, llm, cfg, delta=True)
    sync.push()  # full: the engine's copy and every rank's rows start here
    ratios, times, pauses = [], [], []
    for _ in range(cfg.delta_pushes):
        step()
        before = shardwise.comm_stats()["weight_sync"]
        dist.barrier()
        t0 = time.perf_counter()
        sync.push()
        times.append(slowest(time.perf_counter() - t0))
        pauses.append(slowest(sync.pause_seconds))
        after = shardwise.comm_stats()["weight_sync"]
        if dist.get_rank() == 0:
            ratios.append((after.bytes - before.bytes) / (after.payload_bytes - before.payload_bytes))
    sync.close()
    return {"bytes_ratio": statistics.median(ratios) if ratios else 0.0, "all_ratios": ratios,
            "seconds": statistics.median(times), "pause_seconds": statistics.median(pauses)}


def _stepper(model, cfg: Config):
    """One AdamW training step of ``model`` on a random batch (2 x 64 tokens)."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(cfg.seed + dist.get_rank())

    def step() -> None:
        ids = torch.randint(0, vocab, (2, 64), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def _measure_overlap(model, llm, cfg: Config, base: int, work: Path) -> dict:
    """Steps alone and steps each with a full ``push(wait=False)`` beside it, alternating (so
    that a busy machine's drift falls on both alike; the slowest rank's step, median of
    ``--pushes`` each); and how long each push went on after its step."""
    step = _stepper(model, cfg)
    sync = _sync(model, llm, cfg)
    sync.push()  # warm
    step()

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return slowest(time.perf_counter() - t0)

    alone, beside, after = [], [], []
    for _ in range(cfg.pushes):
        alone.append(timed(step))
        dist.barrier()
        handle = sync.push(wait=False)
        beside.append(timed(step))
        after.append(timed(handle.wait))
    sync.close()
    return {"step_seconds": statistics.median(alone), "step_beside_push_seconds": statistics.median(beside),
            "wait_after_step_seconds": statistics.median(after), "all_alone": alone, "all_beside": beside}


def report(cfg: Config, r: dict) -> None:
    """The table and notes (printed, ``bench_vllm.md``) and every number (``bench_vllm.json``)."""
    floor = r["wire_bytes"] / r["floor_bytes_per_s"]
    sw, naive, delta = r["shardwise"], r.get("naive"), r["delta"]
    allowed = r["bucket_bytes"] + r["largest_unit_bytes"]
    mib = 2**20
    wire = "shm" if cfg.nodes == 1 else f"tcp, {cfg.link} link"

    def vs_naive(s: float) -> str:
        return f"{s / naive['seconds']:.2f}" if naive else ""

    rows = [
        (f"floor (bytes / {floor_of(cfg)})", floor, None, None, "1.00", ""),
        (f"shardwise push ({wire}, bf16)", sw["seconds"], sw["pause_seconds"], sw["extra_bytes"],
         f"{sw['seconds'] / floor:.2f}", vs_naive(sw["seconds"])),
        *([("naive: full_state_dict + reload_weights", naive["seconds"], None, naive["extra_bytes"],
            f"{naive['seconds'] / floor:.2f}", "1.00")] if naive else []),
        (f"shardwise delta push ({wire}, lr {cfg.lr:g})", delta["seconds"], delta["pause_seconds"], None,
         f"{delta['seconds'] / floor:.2f}", vs_naive(delta["seconds"])),
    ]
    lines = [
        f"# shardwise bench --vllm: {r['size']} Llama ({r['params'] / 1e6:.1f}M parameters, "
        f"{r['wire_bytes'] / mib:.1f} MiB in bf16), {r['world']} trainer ranks, vLLM {vllm_version()} on CPU"
        + ("" if cfg.nodes == 1 else f", on a second node across a {cfg.link} link"),
        "",
        "| way | push s | engine pause s | extra peak memory (largest rank) | x floor | x naive |",
        "|---|---|---|---|---|---|",
    ]
    for name, s, pause, extra, xf, xn in rows:
        mem = f"{extra / mib:.1f} MiB" if extra is not None else ""
        paused = f"{pause:.3f}" if pause is not None else ""
        lines.append(f"| {name} | {s:.3f} | {paused} | {mem} | {xf} | {xn} |")
    lines += _notes(cfg, r, floor, allowed)
    write_report(cfg, r, lines, "bench_vllm")


def write_report(cfg, r: dict, lines: list[str], stem: str) -> None:
    """Print the table and keep it, with the raw figures, as ``<out>/<stem>.md`` and ``.json``."""
    text = "\n".join(lines)
    print(text)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text + "\n")
    (out / f"{stem}.json").write_text(json.dumps({"config": asdict(cfg), **r}, indent=1))


def floor_of(cfg: Config) -> str:
    """What bounds a push: the machine's copy bandwidth, or the link's."""
    return "copy bandwidth" if cfg.nodes == 1 else f"{cfg.link} link's measured bandwidth"


def _notes(cfg: Config, r: dict, floor: float, allowed: int) -> list[str]:
    sw, naive, delta, over = r["shardwise"], r.get("naive"), r["delta"], r["overlap"]
    mib = 2**20
    versus = f"; <= 0.5x naive: {sw['seconds'] / naive['seconds']:.2f}" if naive else " (naive: not measured across a link)"
    return [
        "",
        f"- {floor_of(cfg)} {r['floor_bytes_per_s'] / 1e9:.3f} GB/s: floor {floor:.3f} s; bucket "
        f"{r['bucket_bytes'] / mib:.0f} MiB, largest unit {r['largest_unit_bytes'] / mib:.1f} MiB: allowed extra "
        f"{allowed / mib:.1f} MiB, shardwise took {sw['extra_bytes'] / mib:.1f} MiB",
        f"- of a shardwise push, rank 0 waited {sw['engine_wait_seconds']:.3f} s on the engine (loading, "
        "vLLM's layerwise reload and its repacking of weights for the CPU kernels)",
        f"- delta pushes sent {delta['bytes_ratio']:.3f}x a full push's bytes (median of {len(delta['all_ratios'])}: "
        + ", ".join(f"{x:.3f}" for x in delta["all_ratios"]) + ")",
        f"- targets: push <= 1.5x floor: {sw['seconds'] / floor:.2f}{versus}; extra memory <= bucket + largest "
        f"unit: {'yes' if sw['extra_bytes'] <= allowed else 'no'}; delta <= 0.1x: {delta['bytes_ratio']:.3f}; "
        f"delta's engine pause <= 0.1x a full push's: {delta['pause_seconds'] / sw['seconds']:.2f}",
        f"- a training step (AdamW, 2 x 64 tokens) alone {over['step_seconds']:.3f} s, with a full "
        f"push(wait=False) beside it {over['step_beside_push_seconds']:.3f} s "
        f"({over['step_beside_push_seconds'] / over['step_seconds']:.2f}x; target <= 1.15x); the push then "
        f"went on {over['wait_after_step_seconds']:.3f} s after the step",
    ]


def vllm_version() -> str:
    try:
        import vllm
    except ImportError:  # the report's own tests run without the [vllm] extra
        return "not installed"
    return getattr(vllm, "__version__", "?")
