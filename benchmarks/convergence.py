"""Loss curves of the built-in GPT with exact and encoded communication, side by side.

Trains the same job (``shardwise train``'s worker: same seed, batches and schedule) once per
``--comm`` choice, logs the loss at every step, draws the curves into one PNG and writes the
final-loss ratios against exact communication to a JSON file:

    OMP_NUM_THREADS=1 python benchmarks/convergence.py --model-size small --steps 300 \
        --out docs/convergence

The final loss is the mean over the last ``--tail`` steps (one step's loss is one batch's,
noisy); the last step alone is reported too.

``--diloco``: exact hybrid sharding against DiLoCo with ``--messages`` pseudo-gradients
(int8 and top-k; fp32 too on request; H = ``--sync-every``), two nodes of ``--nproc`` ranks
in network namespaces (root): the runs of ``shardwise bench --nodes 2 --diloco`` (its systems
and per-step losses, on a 10gbit link), every system on the same tokens from the same model,
AdamW at ``--lr``, the outer Nesterov SGD at ``--outer-lr`` and ``--outer-momentum``; with
``--warmup-steps W`` DiLoCo starts from exact hybrid's model and AdamW after its first W steps
(its curve's first W steps are exact hybrid's); ``--steps`` rounded to W plus whole rounds;
each curve is the mean of each node's first rank's loss:

    OMP_NUM_THREADS=1 python benchmarks/convergence.py --diloco --model-size tiny --steps 2048 \
        --sync-every 32 --warmup-steps 128 --lr 2e-3 --tail 64 --out docs/convergence-diloco
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from shardwise.core import groups
from shardwise.job import train
from shardwise.observer import charts

COLORS = {"exact": "#000000", "bf16": "#1f77b4", "fp8": "#ff7f0e", "int8": "#2ca02c",
          "diloco+fp32": "#1f77b4", "diloco+int8": "#2ca02c", "diloco+topk": "#d62728"}
SMOOTH = 32  # the main panel's running mean, in steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--comm", nargs="+", default=["exact", "bf16", "int8", "fp8"])
    p.add_argument("--model-size", default="small")
    p.add_argument("--strategy", default="full_shard")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--tail", type=int, default=20, help="final loss: mean over this many last steps")
    p.add_argument("--error-feedback", action="store_true")
    p.add_argument("--out", default="convergence", help="writes OUT.json and OUT.png")
    p.add_argument("--diloco", action="store_true", help="exact hybrid sharding against DiLoCo int8 and top-k")
    p.add_argument("--sync-every", type=int, default=32, help="--diloco: DiLoCo's H")
    p.add_argument("--outer-lr", type=float, default=0.7, help="--diloco: the outer Nesterov SGD's learning rate")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="--diloco: its momentum (0: plain SGD)")
    p.add_argument("--lr", type=float, default=1e-3, help="--diloco: AdamW's, every system's (DiLoCo's inner)")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="--diloco: DiLoCo starts from exact hybrid sharding's model and AdamW after this many steps")
    p.add_argument("--messages", nargs="+", default=["int8", "topk"], choices=["fp32", "int8", "topk"],
                   help="--diloco: DiLoCo's pseudo-gradient messages to run")
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = Path(a.out)
    if a.diloco:
        return diloco(a, out)
    results = json.loads(out.with_suffix(".json").read_text()).get("runs", {}) if out.with_suffix(".json").exists() else {}
    for comm in a.comm:
        cfg = train.TrainConfig(
            nproc=a.nproc, strategy=a.strategy, steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len,
            model_size=a.model_size, log_every=1, comm=comm, error_feedback=a.error_feedback,
        )
        t0 = time.perf_counter()
        summary = groups.launch_local(a.nproc, train.worker, cfg)[0]
        steps, losses = summary["curve"]
        results[comm] = {
            "steps": steps, "losses": losses, "seconds": time.perf_counter() - t0,
            "bytes_per_step": {k: summary["rows"][0][k] for k in ("all_gather", "reduce_scatter", "all_reduce")},
        }
        print(f"{comm}: final loss {losses[-1]:.4f} in {results[comm]['seconds']:.0f} s", flush=True)
        _write(out, a, results)


def diloco(a, out: Path) -> None:
    """``--diloco``: the three systems' per-step losses from ``shardwise bench --nodes 2 --diloco``."""
    from shardwise.bench import diloco as bench

    rounds = max(1, (a.steps - a.warmup_steps) // a.sync_every - 1)  # (timed rounds, after an untimed one)
    a.steps = a.warmup_steps + (rounds + 1) * a.sync_every
    a.strategy = "2 nodes: hybrid_shard vs DiLoCo"
    systems = {"exact": "shardwise/hybrid_shard", **{f"diloco+{m}": f"diloco+{m}" for m in a.messages}}
    runs = out.parent / f"{out.name}-runs"
    t0 = time.perf_counter()
    bench.main([
        "--link", "10gbit", "--sync-every", str(a.sync_every), "--rounds", str(rounds),
        "--exact-steps", str(a.steps - 2), "--model", a.model_size, "--nproc", str(a.nproc),
        "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--systems", ",".join(systems.values()),
        "--outer-lr", str(a.outer_lr), "--outer-momentum", str(a.outer_momentum),
        "--warmup-steps", str(a.warmup_steps), "--lr", str(a.lr), "--out", str(runs),
    ])
    rows = json.loads((runs / "diloco.json").read_text())["rows"]
    warm = rows["shardwise/hybrid_shard"]["losses"][: a.warmup_steps]  # (DiLoCo's first steps: exact's)
    results = {
        name: {"steps": list(range(1, a.steps + 1)), "seconds": time.perf_counter() - t0,
               "losses": rows[system]["losses"] if name == "exact" else warm + rows[system]["losses"]}
        for name, system in systems.items()
    }
    _write(out, a, results)


def _write(out: Path, a, results: dict) -> None:
    base = results.get("exact")
    for r in results.values():
        r["final"] = sum(r["losses"][-a.tail :]) / len(r["losses"][-a.tail :])
        if base is not None:
            r["final_ratio"] = r["final"] / base["final"]
            r["last_step_ratio"] = r["losses"][-1] / base["losses"][-1]
    keys = ["model_size", "strategy", "nproc", "steps", "batch_size", "seq_len", "tail", "error_feedback"]
    if a.diloco:
        keys += ["sync_every", "lr", "outer_lr", "outer_momentum", "warmup_steps", "messages"]
    config = {k: getattr(a, k) for k in keys}
    out.with_suffix(".json").write_text(json.dumps({"config": config, "runs": results}, indent=1))
    if not charts.available():
        return
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax, zoom = fig.subplots(1, 2, width_ratios=[2, 1])
    for name, r in results.items():
        label = name + (f" ({r['final_ratio']:.4f}x)" if "final_ratio" in r else "")
        # (one step's loss is one batch's: the whole run as the running mean of SMOOTH steps)
        smooth = [sum(r["losses"][max(0, i - SMOOTH + 1) : i + 1]) / min(i + 1, SMOOTH) for i in range(len(r["losses"]))]
        ax.plot(r["steps"], smooth, color=COLORS.get(name), lw=0.9, label=label)
        zoom.plot(r["steps"], r["losses"], color=COLORS.get(name), lw=0.8)
    tail = a.steps - 4 * a.tail
    finals = [r["losses"][i] for r in results.values() for i, s in enumerate(r["steps"]) if s > tail]
    zoom.set_xlim(tail, a.steps)
    zoom.set_ylim(min(finals) * 0.98, max(finals) * 1.02)
    ax.set_xlabel("step")
    zoom.set_xlabel("step (last steps)")
    ax.set_ylabel(f"loss (mean over ranks, running mean of {SMOOTH})", fontsize=9)
    ax.legend(title=f"comm (final loss vs exact, last {a.tail})", fontsize=8)
    for axis in (ax, zoom):
        axis.grid(alpha=0.3)
    title = f"{a.model_size} GPT, {a.strategy}, {a.nproc} ranks, {a.steps} steps"
    if a.diloco:
        title += (f"\nDiLoCo H={a.sync_every} after {a.warmup_steps} exact steps, AdamW lr {a.lr:g}, "
                  f"outer Nesterov lr {a.outer_lr:g} momentum {a.outer_momentum:g}")
    fig.suptitle(title, fontsize=9)
    fig.savefig(out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
