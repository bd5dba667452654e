"""CUDA check of CPU offload (issue 3): parity with the non-offloaded run and device peak memory.

    python scripts/gpu_offload_check.py OUTDIR        # one GPU, world size 1 (NCCL)

Trains the medium GPT for a few steps with and without ``cpu_offload`` (fp32, and bf16 mixed
precision), compares the losses (the offloaded optimizer steps on the CPU, so agreement is to
rounding, not bitwise), and records torch.cuda.max_memory_allocated for each run in
OUTDIR/offload.json and OUTDIR/offload.md.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

import shardwise
from shardwise.data import get_batch
from shardwise.models import GPT, Block, gpt_config


def run(cpu_offload: bool, mixed_precision: str | None, steps: int = 6) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(gpt_config("medium", seq_len=256))
    shardwise.shard(model, wrap=shardwise.wrap.by_class(Block), cpu_offload=cpu_offload,
                    mixed_precision=mixed_precision)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if cpu_offload else {}))
    losses, times = [], []
    for step in range(steps):
        x, y = (t.cuda() for t in get_batch(step, 8, 256))
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return {
        "cpu_offload": cpu_offload,
        "mixed_precision": mixed_precision or "none",
        "losses": losses,
        "peak_device_MiB": torch.cuda.max_memory_allocated() / 2**20,
        "median_step_ms": 1000 * sorted(times[1:])[len(times[1:]) // 2],
        "shard_device": str(next(model.parameters()).device),
    }


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("this check needs a CUDA GPU")
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    shardwise.init()
    results = []
    for mp in (None, "bf16"):
        base, off = run(False, mp), run(True, mp)
        worst = max(abs(a - b) / abs(a) for a, b in zip(base["losses"], off["losses"]))
        results += [base, off]
        print(f"{mp or 'fp32'}: peak {base['peak_device_MiB']:.0f} MiB -> {off['peak_device_MiB']:.0f} MiB "
              f"with offload; step {base['median_step_ms']:.1f} -> {off['median_step_ms']:.1f} ms; "
              f"worst relative loss difference {worst:.2e}", flush=True)
        assert off["shard_device"] == "cpu"
        assert worst < (1e-5 if mp is None else 2e-2), worst
    (out / "offload.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "runs": results}, indent=1))
    lines = ["| precision | offload | peak device MiB | median step ms |", "|---|---|---|---|"]
    lines += [f"| {r['mixed_precision']} | {r['cpu_offload']} | {r['peak_device_MiB']:.0f} | {r['median_step_ms']:.1f} |" for r in results]
    (out / "offload.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
