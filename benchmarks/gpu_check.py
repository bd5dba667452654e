"""One-GPU check of shardwise's CUDA path: parity, step-time overhead, MFU, peak memory, offload.

    python benchmarks/gpu_check.py "$OUT"                         # one GPU (N=2 parity if two)
    python benchmarks/gpu_check.py /tmp/gc --device cpu --size tiny --seq-len 32 --batch-size 2 \\
        --rounds 1 --steps 2 --warmup 1 --parity-steps 2          # smoke run of the non-CUDA lines

In one run, sized to finish in well under 5 minutes on an H200:
1. Parity (fp32): shardwise full_shard against the plain module on the same batches, every
   step's loss (1e-5 relative) and the final parameters, at world size 1 and, when the machine
   has two GPUs, at world size 2 (two local ranks, NCCL; the plain module on the global batch);
   each in rows and with the blocks' matrices owned (NCCL's padded ragged collectives).
2. Speed (bf16, the ~100M GPT, 16 x 1024 tokens a step): the plain module under
   ``torch.autocast`` with fp32 parameters, shardwise full_shard (``mixed_precision="bf16"``)
   and FSDP2 full_shard (bf16 parameters, fp32 reduction), each eager and with every block
   compiled; all alternate in rounds after warm-up (which compiles). Median step time,
   tokens/s, MFU against the GPU's dense bf16 peak, and the overhead over the plain module
   (target <= 3%). First-step losses must agree (2e-2 relative: bf16 rounding differs).
3. Peak ``torch.cuda.max_memory_allocated`` of each, alone on the device, against FSDP2's.
4. Offload: shardwise full_shard bf16 with ``cpu_offload=True``: step time, device peak and
   losses against the same run without offload (the optimizer steps on the host: 2e-2).
5. Per-unit overhead with NCCL: ``shardwise bench --overhead``'s model (32, 128 and 512 blocks of
   ``Linear(32, 32)`` + ``LayerNorm``) in the plain module, DDP, FSDP2 and shardwise at N=1 (and
   N=2 with two GPUs): step time and host µs per unit per phase (docs/benchmarks.md).
6. DiLoCo's codecs on the device (``ft.diloco(comm="int8" | "topk")``, issue 41): a
   pseudo-gradient of 4M values encoded on the device and on the CPU; each message must have
   the codec's size and decode to the same values on either device (decoding is exact
   arithmetic), and the device's encoding must drop what the CPU's drops (relative
   difference of the decoded values <= 1e-3: top-k's means sum in another order).
Prints one table, writes gpu_check.json and gpu_check.md to the directory given, and exits
non-zero when a check fails.
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
from datetime import datetime, timezone
from pathlib import Path

import torch

import shardwise
from shardwise.bench import overhead as unit_overhead
from shardwise.job.data import get_batch, rank_slice
from shardwise.job.models import GPT, Block, gpt_config

# dense bf16 peak of each GPU (TFLOP/s, without sparsity), by a part of its name
PEAK_TFLOPS = {"H200": 989.0, "H100 SXM": 989.0, "H100 80GB HBM3": 989.0, "H100 PCIe": 756.0, "A100": 312.0}
SPEED_SYSTEMS = ("plain", "shardwise", "fsdp2")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="directory for gpu_check.json and gpu_check.md")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run")
    p.add_argument("--size", choices=("tiny", "small", "medium", "large"), default="large")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=4, help="alternations of the timed systems")
    p.add_argument("--steps", type=int, default=5, help="timed steps per system per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per system first")
    p.add_argument("--parity-steps", type=int, default=5)
    p.add_argument("--overhead-units", default="32,128,512", help="block counts of the per-unit overhead check")
    p.add_argument("--overhead-steps", type=int, default=25, help="timed steps per system and size")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: by GPU name)")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- systems
def build(system: str, args, device: torch.device, *, bf16: bool = True, compiled: bool = False,
          offload: bool = False, placement=None):
    """Model, optimizer and forward context of ``system`` from seed 0 (compiled: every block)."""
    torch.manual_seed(0)
    with device:
        model = GPT(gpt_config(args.size, seq_len=args.seq_len))
    autocast = contextlib.nullcontext
    if system == "shardwise":
        shardwise.shard(model, wrap=shardwise.wrap.by_class(Block), mixed_precision="bf16" if bf16 else None,
                        cpu_offload=offload, placement=placement)
    elif system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    elif bf16:  # the plain module: fp32 parameters, bf16 matmuls

        def autocast():
            return torch.autocast(device.type, dtype=torch.bfloat16)

    if compiled:
        for block in model.blocks:
            block.compile()
    # offloaded shards step on the host; elsewhere the fused kernel of the device
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda" or offload)
    return model, opt, autocast


def step(run, x, y, device: torch.device) -> tuple[float, float]:
    """One training step of ``run``: its loss and seconds (the device synchronised at both ends)."""
    model, opt, autocast = run
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with autocast():
        loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()
    return loss.item(), time.perf_counter() - t0


def peak_alone(make, batches, device: torch.device) -> int:
    """Peak allocated bytes over two steps of a freshly built system, alone on the device."""
    if device.type != "cuda":
        return 0
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    run = make()
    for x, y in batches[:2]:
        step(run, x, y, device)
    peak = torch.cuda.max_memory_allocated()
    del run
    gc.collect()
    return peak


# --------------------------------------------------------------------------- checks
def parity(args, device: torch.device, rank: int = 0, world: int = 1, placement=None) -> dict:
    """fp32 shardwise full_shard against the plain module on the global batch, on this rank
    (``placement``: e.g. the blocks' matrices owned, NCCL's padded gathers and reductions)."""
    plain = build("plain", args, device, bf16=False)
    sharded = build("shardwise", args, device, bf16=False, placement=placement)
    ref_losses, losses = [], []
    for i in range(args.parity_steps):
        x, y = (t.to(device) for t in get_batch(i, args.batch_size * world, args.seq_len))
        ref_losses.append(step(plain, x, y, device)[0])
        loss, _ = step(sharded, rank_slice(x, rank, world), rank_slice(y, rank, world), device)
        t = torch.tensor([loss], device=device)
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
    full = shardwise.full_state_dict(sharded[0])
    ref = plain[0].state_dict()
    diff = max((full[k].to(device) - v).abs().max().item() for k, v in ref.items()) if full else 0.0
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    lr_bound = 2 * 3e-4 * args.parity_steps  # what Adam's sign noise on near-zero gradients can add
    tol = 1e-5 if world == 1 else 1e-4
    return {"world": world, "loss_rel": rel, "param_diff": diff, "ok": rel <= tol and diff <= lr_bound,
            "tol": tol, "param_bound": lr_bound, "placement": "owned" if placement else "rows"}


def _parity_rank(args) -> list[dict]:
    shardwise.init()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = shardwise.core.groups.device()
    return [parity(args, device, rank, world), parity(args, device, rank, world, shardwise.placement.matrices)]


def speed(args, device: torch.device, batches) -> dict:
    """Every system eager and compiled, alternating rounds; then each one's peak alone."""
    names = [(s, c) for c in (False, True) for s in SPEED_SYSTEMS]
    runs = {n: build(n[0], args, device, compiled=n[1]) for n in names}
    times = {n: [] for n in names}
    first = {}
    for n in names:  # warm-up: allocator, kernels, optimizer state, compilation
        for _i, (x, y) in enumerate(batches[: args.warmup]):
            loss, _ = step(runs[n], x, y, device)
            first.setdefault(n, loss)
    for r in range(args.rounds):
        for n in names:
            for x, y in batches[args.warmup + r * args.steps : args.warmup + (r + 1) * args.steps]:
                times[n].append(step(runs[n], x, y, device)[1])
    del runs
    peaks = {n: peak_alone(lambda n=n: build(n[0], args, device, compiled=n[1]), batches, device) for n in names}
    return {"times": times, "first": first, "peaks": peaks}


def offload(args, device: torch.device, batches) -> dict:
    """shardwise bf16 with and without cpu_offload: losses, step times, device peaks."""
    out = {}
    for off in (False, True):
        peak = peak_alone(lambda off=off: build("shardwise", args, device, offload=off), batches, device)
        run = build("shardwise", args, device, offload=off)
        losses, times = [], []
        for x, y in batches[: args.warmup + args.steps]:
            loss, dt = step(run, x, y, device)
            losses.append(loss)
            times.append(dt)
        del run
        out[off] = {"losses": losses, "times": times[args.warmup :], "peak": peak}
    rel = max(abs(a - b) / abs(b) for a, b in zip(out[True]["losses"], out[False]["losses"]))
    return {"runs": out, "loss_rel": rel, "ok": rel <= 2e-2}


def diloco_codecs(device: torch.device, numel: int = 1 << 22) -> list[dict]:
    """Each DiLoCo codec's message for the same pseudo-gradient, encoded on ``device`` and on
    the CPU: its size, decoding across devices, and the device's encoding against the CPU's."""
    from shardwise.core.codecs import Codec
    from shardwise.ft.topk import TopK2Bit

    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * torch.rand(numel).pow(4)
    rows = []
    x_device = x.to(device)
    for codec in (Codec("int8"), TopK2Bit()):
        codec.encode(x_device)  # (warm-up)
        _sync(device)
        t0 = time.perf_counter()
        on_device = codec.encode(x_device)
        _sync(device)
        seconds = time.perf_counter() - t0
        on_cpu = codec.encode(x)
        decoded = codec.decode(on_device, numel)
        across = (decoded.cpu() - codec.decode(on_device.cpu(), numel)).abs().max().item()
        reference = codec.decode(on_cpu, numel)
        rel = ((decoded.cpu() - reference).norm() / reference.norm()).item()
        dropped = ((x - decoded.cpu()).norm() / x.norm()).item()
        size_ok = on_device.numel() == codec.nbytes(numel) and on_device.device.type == device.type
        rows.append({
            "run": f"DiLoCo {codec.name} codec ({numel:,} values)", "blocks": "-", "precision": "fp32",
            "median_ms": 1e3 * seconds, "p25_ms": 1e3 * seconds, "p75_ms": 1e3 * seconds,
            "check": f"{on_device.numel():,} bytes, decoded across devices {across:.1e} (0), against the "
                     f"CPU's encoding {rel:.1e} (<= 1e-3), dropped {dropped:.3f} of the norm",
            "ok": size_ok and across == 0 and rel <= 1e-3,
        })
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def flops_per_token(model_cfg, num_params: int) -> float:
    """Training FLOPs per token: 6 per weight (forward and backward) plus attention's
    12 x layers x width x sequence (PaLM's estimate, as nanoGPT's MFU); the position table is
    a lookup, not a matmul."""
    weights = num_params - model_cfg.seq_len * model_cfg.d_model
    return 6 * weights + 12 * model_cfg.n_layer * model_cfg.d_model * model_cfg.seq_len


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: CUDA is not available; run it on a GPU machine, or pass --device cpu")
    t_start = time.perf_counter()
    n_gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.device == "cpu":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    # N=2 first, in its own processes, before this one holds device memory
    parity2 = shardwise.core.groups.launch_local(2, _parity_rank, args)[0] if n_gpus >= 2 else [None]
    ocfg = unit_overhead.OverheadConfig(
        units=tuple(int(n) for n in args.overhead_units.split(",")), nprocs=(1, 2) if n_gpus >= 2 else (1,),
        steps=args.overhead_steps, out=args.out,
    )
    per_unit = {
        str(n): unit_overhead.per_unit(shardwise.core.groups.launch_local(n, unit_overhead.run_rank, ocfg)[0])
        for n in ocfg.nprocs
    }
    shardwise.init(backend="gloo" if args.device == "cpu" else None)
    device = shardwise.core.groups.device() if args.device == "cuda" else torch.device("cpu")
    parity1 = [parity(args, device), parity(args, device, placement=shardwise.placement.matrices)]
    n = args.warmup + args.rounds * args.steps
    batches = [tuple(t.to(device) for t in get_batch(i % 8, args.batch_size, args.seq_len)) for i in range(n)]
    sp = speed(args, device, batches)
    off = offload(args, device, batches)

    mcfg = gpt_config(args.size, seq_len=args.seq_len)
    num_params = sum(p.numel() for p in GPT(mcfg).parameters())
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak_tflops = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    tokens = args.batch_size * args.seq_len
    fpt = flops_per_token(mcfg, num_params)
    rows = []
    for (system, compiled), ts in sp["times"].items():
        med = statistics.median(ts)
        base = statistics.median(sp["times"][("plain", compiled)])
        fsdp2 = sp["peaks"][("fsdp2", compiled)]
        first_ref = sp["first"][("plain", False)]
        rel = abs(sp["first"][(system, compiled)] - first_ref) / abs(first_ref)
        rows.append({
            "run": system, "blocks": "compiled" if compiled else "eager", "precision": "bf16",
            "median_ms": 1e3 * med, "p25_ms": 1e3 * _q(ts, 0.25), "p75_ms": 1e3 * _q(ts, 0.75),
            "tokens_per_s": tokens / med,
            "mfu": tokens / med * fpt / (peak_tflops * 1e12) if peak_tflops else None,
            "vs_plain": med / base - 1, "peak_bytes": sp["peaks"][(system, compiled)],
            "vs_fsdp2_peak": sp["peaks"][(system, compiled)] / fsdp2 - 1 if fsdp2 else None,
            "check": f"first loss {rel:.1e} from plain eager (<= 2e-2)", "ok": rel <= 2e-2,
        })
    for flag, r in off["runs"].items():
        med = statistics.median(r["times"])
        rows.append({
            "run": "shardwise" + (" + cpu_offload" if flag else ""), "blocks": "eager", "precision": "bf16",
            "median_ms": 1e3 * med, "p25_ms": 1e3 * _q(r["times"], 0.25), "p75_ms": 1e3 * _q(r["times"], 0.75),
            "tokens_per_s": tokens / med, "mfu": tokens / med * fpt / (peak_tflops * 1e12) if peak_tflops else None,
            "vs_plain": None, "peak_bytes": r["peak"],
            "vs_fsdp2_peak": None,
            "check": f"losses {off['loss_rel']:.1e} from no offload (<= 2e-2)" if flag else "offload baseline",
            "ok": off["ok"] if flag else True,
        })
    rows += diloco_codecs(device)
    for p in parity1 + parity2:
        if p is None:
            rows.append({"run": "parity N=2", "check": "skipped: one GPU", "ok": True})
            continue
        rows.append({
            "run": f"parity N={p['world']} (shardwise {p['placement']} vs plain)", "blocks": "eager",
            "precision": "fp32",
            "check": f"losses {p['loss_rel']:.1e} (<= {p['tol']:.0e}), parameters {p['param_diff']:.1e} "
                     f"(<= {p['param_bound']:.0e})",
            "ok": p["ok"],
        })
    summary = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": name, "gpus": n_gpus if device.type == "cuda" else 0, "torch": torch.__version__,
        "config": vars(args), "num_params": num_params, "tokens_per_step": tokens,
        "flops_per_token": fpt, "peak_tflops": peak_tflops, "rows": rows, "overhead_per_unit": per_unit,
        "wall_s": time.perf_counter() - t_start,
    }
    md = render(summary) + "\n\nPer-unit overhead (`shardwise bench --overhead`): " + unit_overhead.render_markdown(
        ocfg, per_unit
    )
    print(md, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "gpu_check.md").write_text(md + "\n")
    if not all(r["ok"] for r in rows):
        raise SystemExit("gpu_check: a check failed: " + "; ".join(r["check"] for r in rows if not r["ok"]))


def _q(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=4, method="inclusive")[int(q * 4) - 1] if len(xs) > 1 else xs[0]


def _f(x, spec: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def render(s: dict) -> str:
    c = s["config"]
    lines = [
        (
            f"{s['date']}: {s['device']} ({s['gpus']} GPU(s)), torch {s['torch']}; GPT {c['size']} "
            f"({s['num_params'] / 1e6:.1f}M parameters), {c['batch_size']} x {c['seq_len']} tokens a "
            f"step; {c['rounds']} rounds x {c['steps']} timed steps per system after {c['warmup']} "
            f"warm-up; MFU against {_f(s['peak_tflops'], '.0f')} TFLOP/s dense bf16, "
            f"{s['flops_per_token'] / 1e9:.2f} GFLOP per token; {s['wall_s']:.0f} s in all"
        ),
        "",
        "| run | blocks | precision | median ms (p25-p75) | tokens/s | MFU | vs plain | peak GiB | vs FSDP2 peak | check |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in s["rows"]:
        timing = (f"{r['median_ms']:.1f} ({r['p25_ms']:.1f}-{r['p75_ms']:.1f})" if "median_ms" in r else "-")
        lines.append(
            f"| {r['run']} | {r.get('blocks', '-')} | {r.get('precision', '-')} | {timing} | "
            f"{_f(r.get('tokens_per_s'), ',.0f')} | {_f(r.get('mfu'), '.1%')} | {_f(r.get('vs_plain'), '+.1%')} | "
            f"{_f(r.get('peak_bytes') or None, '.2f', 2**-30)} | {_f(r.get('vs_fsdp2_peak'), '+.1%')} | "
            f"{'ok' if r['ok'] else 'FAIL'}: {r['check']} |"
        )
    lines += ["", "Target: shardwise's step time at most 3% over the plain module's ('vs plain'), eager and compiled."]
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
