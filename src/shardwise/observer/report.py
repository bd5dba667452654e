"""``shardwise report``: one self-contained HTML page built from a trace.

    shardwise report run.trace.json -o report.html [--step N] [--chrome run.chrome.json]

The page shows one recorded step on every rank: a timeline (compute, all-gather,
reduce-scatter or all-reduce and, with hybrid sharding, the all-reduce across replicas, with
the time each rank was blocked), memory over time by
category, a mechanism view that replays the step event by event (which units are sharded,
in flight or gathered on each rank, and which reductions are in flight; Reset, Play, Pause and
Step), and the run's figures: bytes sent against theory and memory against DDP. Everything it
shows is computed here by ``build`` from the trace; the page's script only draws it, and it
needs no network (the data, styles and script are inlined).
"""

from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path

import torch

from ..core.policies import Sharding
from . import accounting
from . import trace as T

TEMPLATE = "report_template.html"


def _itemsize(dtype: str | None) -> int:
    return getattr(torch, dtype or "float32").itemsize


def build(data: dict, step: int = -1) -> dict:
    """The page's data for one step (index into the recorded steps; -1: the last)."""
    ranks = data["ranks"]
    n_steps = min(len(r["steps"]) for r in ranks)
    if n_steps == 0:
        raise ValueError("the trace holds no step: trace at least one forward and backward")
    index = step if step >= 0 else n_steps + step
    if not 0 <= index < n_steps:
        raise ValueError(f"step {step} is out of range: the trace holds {n_steps} step(s)")
    units = data["units"]
    t0 = min(r["steps"][index][0] for r in ranks)  # ranks share a clock (see trace's doc)
    view_ranks, merged = [], []
    for r in ranks:
        start, end = r["steps"][index]
        spans = [s for s in T.spans(r, units) if s["start"] < end and s["end"] > start]
        for s in spans:
            s["start"], s["end"] = _rel(max(s["start"], start), t0), _rel(min(s["end"], end), t0)
        _depths(spans)
        view_ranks.append({
            "rank": r["rank"],
            "spans": spans,
            "lanes": {t: T.lanes([s for s in spans if s["track"] == t]) for t in ("gather", "reduce", "replicate")},
            "memory": [[_rel(m[0], t0), *m[2:]] for m in r["memory"] if start <= m[0] <= end and m[1] != "meta"],
            "initial": _states_before(r["events"], start, units),
            "start": _rel(start, t0),
            "end": _rel(end, t0),
        })
        merged += [
            [_rel(e[0], t0), r["rank"], e[1], e[2], *e[3:4]]
            for e in r["events"] if start <= e[0] <= end and e[1] in MECHANISM_EVENTS
        ]
    merged.sort(key=lambda e: (e[0], e[1]))
    return {
        "title": _title(data),
        "step": index,
        "steps": n_steps,
        "world_size": data["world_size"],
        "strategy": data["strategy"],
        "mesh": _mesh(data),
        "categories": data["categories"],
        "units": [u["name"] for u in units],
        "unit_kinds": [u["kind"] for u in units],
        "duration": max(v["end"] for v in view_ranks),
        "ranks": view_ranks,
        "events": merged,
        "figures": figures(data, index),
    }


# the events that change what the mechanism view shows
MECHANISM_EVENTS = (
    "forward", "backward", "optimizer", "gather_issue", "gather_done", "reshard", "reduce_issue", "reduce_done",
    "reduce_complete", "step_end",
)


def _rel(t: float, t0: float) -> float:
    return round(t - t0, 7)


def _depths(spans: list[dict]) -> None:
    """Nesting depth of each compute span (a unit's forward inside the root's forward)."""
    stack: list[float] = []
    for s in spans:
        if s["track"] != "compute":
            continue
        while stack and stack[-1] <= s["start"]:
            stack.pop()
        s["depth"] = len(stack)
        stack.append(s["end"])


def _states_before(events: list[list], t: float, units: list[dict]) -> list[str]:
    """Each unit's state on one rank just before time ``t``: replays the rank's events."""
    states = ["whole" if u["kind"] == "replicated" else "sharded" for u in units]
    for e in events:
        if e[0] >= t:
            break
        if e[2] < 0 or units[e[2]]["kind"] == "replicated":
            continue
        states[e[2]] = _STATE_AFTER.get(e[1], states[e[2]])
    return states


_STATE_AFTER = {"gather_issue": "gathering", "gather_done": "gathered", "reshard": "sharded"}


def _mesh(data: dict) -> dict:
    """Replicas (R) and shard group size (S); traces from before hybrid sharding: (1, N)."""
    return data.get("mesh") or {"replicate": 1, "shard": data["world_size"]}


def figures(data: dict, index: int) -> dict:
    """Bytes each rank sent in the step against theory, and memory against DDP. With hybrid
    sharding the bytes are also split by link: within the shard groups (gathers and
    reduce-scatters over S ranks) and across them (the replicate all-reduce over R ranks)."""
    n = data["world_size"]
    mesh = _mesh(data)
    reps, s = mesh["replicate"], mesh["shard"]
    units = data["units"]
    psi = sum(u["params"] for u in units)
    b_gather = _itemsize(data["precision"]["param_dtype"])
    b_reduce = _itemsize(data["precision"]["reduce_dtype"] or data["precision"]["param_dtype"])
    trained = sum(u.get("trained", 0) for u in units)
    theory = accounting.theory(
        data["strategy"], psi, world=n, replicate=reps, b_gather=b_gather, b_reduce=b_reduce, trained=trained
    )
    formula = accounting.formula(data["strategy"], b_gather == b_reduce) + " + step check"
    # the ranks each kind runs over: gathers, reduce-scatters and clipping's all-reduce in
    # the shard group (the world, without hybrid sharding); all-reduces move twice
    over = {"all_gather": s, "reduce_scatter": s, "all_reduce": s, "replicate_all_reduce": reps, "step_check": n}
    twice = ("all_reduce", "replicate_all_reduce", "step_check")
    sent, blocked, comm_time, step_time, ddp_state = [], [], [], [], 0
    for r in data["ranks"]:
        start, end = r["steps"][index]
        by_kind = dict.fromkeys(theory, 0)
        collectives = [e for e in r["events"] if e[1] == "collective" and start <= e[0] <= end]
        for _, _, _, kind, payload, _, _ in collectives:
            if kind in by_kind:
                by_kind[kind] += (1 + (kind in twice)) * payload * (over[kind] - 1) // over[kind]
        comm = [x for x in T.spans(r, units) if x["track"] != "compute" and start <= x["start"] <= end]
        sent.append(by_kind)
        blocked.append(round(sum(e[6] for e in collectives), 7))
        comm_time.append(round(sum(x["end"] - x["start"] for x in comm), 7))
        step_time.append(round(end - start, 7))
        ends = {e[0] for e in r["events"] if e[1] == "step_end"}
        opt = [m[2 + data["categories"].index("optimizer")] for m in r["memory"] if m[0] in ends]
        ddp_state += max(opt, default=0)  # DDP holds all of the optimizer state on every rank,
    ddp_state += 2 * sum(u["params"] * _itemsize(u["dtype"]) for u in units)  # whole params, grads
    ranks = [r["rank"] for r in data["ranks"]]
    summary = T.summary(data)
    devices = {r: {d["device"]: d for d in summary if d["rank"] == r} for r in ranks}
    gpu = {r: next((d for k, d in devices[r].items() if k != "cpu"), None) for r in ranks}
    links = None
    if "replicate_all_reduce" in theory:
        within = ("all_gather", "reduce_scatter", "all_reduce")
        links = {
            "within": [sum(x[k] for k in within) for x in sent],
            "across": [x["replicate_all_reduce"] for x in sent],
            "theory_within": sum(theory[k] for k in within),
            "theory_across": theory["replicate_all_reduce"],
        }
    return {
        "psi": psi,
        "formula": formula,
        "theory": theory,
        "sent": sent,
        "links": links,
        "blocked_s": blocked,
        "comm_s": comm_time,
        "step_s": step_time,
        "peak": [(gpu[r] or devices[r]["cpu"])["peak"] for r in ranks],  # the compute device's
        "host": [devices[r]["cpu"]["peak"] if gpu[r] and "cpu" in devices[r] else 0 for r in ranks],
        "model_state": [sum(d["model_state"] for d in devices[r].values()) for r in ranks],
        "ddp_model_state": ddp_state,
    }


def _title(data: dict) -> str:
    p = data["precision"]
    precision = p["param_dtype"] or "fp32"
    mesh = _mesh(data)
    layout = (
        f" ({mesh['replicate']} replicas x {mesh['shard']} shards)"
        if Sharding.of(data["strategy"]).hybrid
        else ""
    )
    return (
        f"{data['strategy']} on {data['world_size']} rank{'s' * (data['world_size'] > 1)}{layout}, "
        f"{len(data['units'])} units, {sum(u['params'] for u in data['units']):,} parameters, "
        f"compute {precision}{', cpu offload' if data['cpu_offload'] else ''}"
    )


def render(view: dict) -> str:
    """The page: the template with the view inlined as JSON."""
    template = resources.files("shardwise.observer").joinpath(TEMPLATE).read_text(encoding="utf-8")
    payload = json.dumps(view, separators=(",", ":")).replace("</", "<\\/")
    return template.replace("/*__SHARDWISE_DATA__*/null", payload)


def write(trace_data: dict, out: str | Path, step: int = -1) -> Path:
    """Build the page for one step of ``trace_data`` and write it to ``out``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(build(trace_data, step)), encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="shardwise report",
        description="an HTML page of one traced step: timeline, memory, mechanism, figures",
    )
    ap.add_argument("trace", help="a compact trace written by shardwise.trace(...).save()")
    ap.add_argument("-o", "--output", default="report.html")
    ap.add_argument("--step", type=int, default=-1, help="which recorded step (default: the last)")
    ap.add_argument(
        "--chrome", help="also write the trace in Chrome's format here (Perfetto, chrome://tracing)"
    )
    a = ap.parse_args(argv)
    data = T.load(a.trace)
    path = write(data, a.output, a.step)
    print(f"wrote {path}")
    if a.chrome:
        Path(a.chrome).write_text(json.dumps(T.to_chrome(data)))
        print(f"wrote {a.chrome}")
