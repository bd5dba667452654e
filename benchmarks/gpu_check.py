"""One-GPU check: the ~100M built-in GPT in bf16 under shardwise full_shard and as a plain module.

    python benchmarks/gpu_check.py "$OUT"                              # one GPU, world size 1
    python benchmarks/gpu_check.py /tmp/gc --device cpu --size tiny --steps 2 --seq-len 32

Both train the same model from the same seed on the same batches with AdamW on fp32 weights,
computing in bf16: shardwise with ``mixed_precision="bf16"`` (fp32 master shards, bf16 gather
and compute, fp32 gradient reduction), the plain module under ``torch.autocast(bfloat16)`` with
fp32 parameters (the usual way to train a plain module in bf16). They alternate in rounds after
a warm-up; a step is forward, backward and ``optimizer.step()``, timed after a device
synchronise. Peak memory is ``torch.cuda.max_memory_allocated`` with each system alone on the
device. Writes gpu_check.json and gpu_check.md to the directory given; sized to finish well
under 4 minutes on an H200 (about 50 steps of 16k tokens, plus start-up).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import shardwise
from shardwise.data import get_batch
from shardwise.models import GPT, Block, gpt_config

SYSTEMS = ("plain", "shardwise")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="directory for gpu_check.json and gpu_check.md")
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: a reduced run to test the script",
    )
    p.add_argument(
        "--size", choices=("tiny", "small", "medium", "large"), default="large", help="GPT size"
    )
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=4, help="alternations of the two systems")
    p.add_argument("--steps", type=int, default=5, help="timed steps per system per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per system first")
    return p.parse_args(argv)


def build(name: str, args, device: torch.device):
    """Model, optimizer and forward context of ``name``, from the same seed."""
    torch.manual_seed(0)
    with device:
        model = GPT(gpt_config(args.size, seq_len=args.seq_len))
    autocast = contextlib.nullcontext()
    if name == "shardwise":
        shardwise.shard(
            model,
            wrap=shardwise.wrap.by_class(Block),
            strategy="full_shard",
            mixed_precision="bf16",
        )
    else:
        autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    return (
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda"),
        autocast,
    )


def step(model, opt, autocast, x, y, device: torch.device) -> tuple[float, float]:
    """One training step; its loss and its seconds (the device synchronised at both ends)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with autocast:
        loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()
    return loss.item(), time.perf_counter() - t0


def peak_alone(name: str, args, device: torch.device, batches) -> int:
    """Peak allocated bytes of two steps of ``name`` with nothing else on the device."""
    if device.type != "cuda":
        return 0
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model, opt, autocast = build(name, args, device)
    for x, y in batches[:2]:
        step(model, opt, autocast, x, y, device)
    peak = torch.cuda.max_memory_allocated()
    del model, opt
    return peak


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "gpu_check: CUDA is not available (torch.cuda.is_available() is False); "
            "run it on a GPU machine, or pass --device cpu for a reduced test run"
        )
    shardwise.init()  # world size 1 without torchrun; NCCL on CUDA
    device = shardwise.groups.device() if args.device == "cuda" else torch.device("cpu")
    n = args.warmup + args.rounds * args.steps
    batches = [
        tuple(t.to(device) for t in get_batch(i % 8, args.batch_size, args.seq_len))
        for i in range(n)
    ]
    t_start = time.perf_counter()
    runs = {name: build(name, args, device) for name in SYSTEMS}
    num_params = sum(p.numel() for p in runs["plain"][0].parameters())
    times: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    losses: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    for name in SYSTEMS:  # warm-up: allocator, kernels, optimizer state
        for x, y in batches[: args.warmup]:
            losses[name].append(step(*runs[name], x, y, device)[0])
    for r in range(args.rounds):
        for name in SYSTEMS:
            for x, y in batches[args.warmup + r * args.steps : args.warmup + (r + 1) * args.steps]:
                loss, dt = step(*runs[name], x, y, device)
                losses[name].append(loss)
                times[name].append(dt)
    del runs
    peaks = {name: peak_alone(name, args, device, batches) for name in SYSTEMS}
    tokens = args.batch_size * args.seq_len
    rows = {}
    for name in SYSTEMS:
        med = statistics.median(times[name])
        qs = statistics.quantiles(times[name], n=4) if len(times[name]) > 1 else [med, med, med]
        rows[name] = {
            "median_ms": 1e3 * med,
            "p25_ms": 1e3 * qs[0],
            "p75_ms": 1e3 * qs[2],
            "tokens_per_s": tokens / med,
            "peak_bytes": peaks[name],
            "step_ms": [1e3 * t for t in times[name]],
        }
    overhead = rows["shardwise"]["median_ms"] / rows["plain"]["median_ms"] - 1
    first = [losses[s][0] for s in SYSTEMS]
    rel = abs(first[1] - first[0]) / abs(first[0])
    summary = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "config": vars(args),
        "num_params": num_params,
        "tokens_per_step": tokens,
        "systems": rows,
        "overhead": overhead,
        "first_losses": dict(zip(SYSTEMS, first)),
        "first_loss_rel_diff": rel,
        "wall_s": time.perf_counter() - t_start,
    }
    md = render(summary)
    print(md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "gpu_check.md").write_text(md + "\n")
    if rel > 2e-2:  # bf16 compute: same work, not the same rounding
        raise SystemExit(
            f"gpu_check: first-step losses differ by {rel:.1e} (relative): {summary['first_losses']}"
        )


def render(s: dict) -> str:
    c = s["config"]
    lines = [
        (
            f"{s['date']}: {s['device']}, torch {s['torch']}, world size 1; GPT {c['size']} "
            f"({s['num_params'] / 1e6:.1f}M parameters), batch {c['batch_size']} x {c['seq_len']} tokens, "
            f"bf16 compute, fp32 AdamW; {c['rounds']} rounds x {c['steps']} timed steps per system "
            f"after {c['warmup']} warm-up"
        ),
        "",
        "| system | median ms | p25-p75 ms | tokens/s | peak GiB |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in s["systems"].items():
        peak = f"{r['peak_bytes'] / 2**30:.2f}" if r["peak_bytes"] else "-"
        lines.append(
            f"| {name} | {r['median_ms']:.1f} | {r['p25_ms']:.1f}-{r['p75_ms']:.1f} | "
            f"{r['tokens_per_s']:,.0f} | {peak} |"
        )
    lines += [
        "",
        (
            f"shardwise step-time overhead over the plain module: {100 * s['overhead']:+.1f}% "
            f"(target <= 3%); first-step losses differ by {s['first_loss_rel_diff']:.1e} (relative)."
        ),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
