"""Tracer, Chrome export and the data the report is built from (the planner: test_plan.py).

The tracer is checked against torch's MemTracker and against shardwise's own accounting.
"""

from __future__ import annotations

import json
import threading
import warnings

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.core import events
from shardwise.job.models import GPT, Block, gpt_config
from shardwise.observer import report
from shardwise.observer import trace as T
from shardwise.observer.accounting import kept_buckets

# a built-in GPT small enough for CPU tests, big enough that model state and activations
# are both megabytes
CFG = dict(d_model=128, n_layer=3, n_head=4, seq_len=64, mlp_ratio=4)
BATCH = 4  # sequences per rank


def gpt():
    return GPT(gpt_config("tiny", **CFG))


def tokens(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's micro-batch: random byte tokens (memory does not depend on the text)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 256, (BATCH, CFG["seq_len"] + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def traced_run(
    strategy="full_shard", wrap=True, precision=None, offload=False, checkpoint=False, steps=2,
    **options,
):
    """Build the GPT, take one untraced step (the optimizer state appears), trace ``steps``
    (``options`` go to ``shard()``)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = gpt()
    block = shardwise.wrap.by_class(Block)
    shardwise.shard(
        model,
        wrap=block if wrap else None,
        strategy=strategy,
        mixed_precision=precision,
        cpu_offload=offload,
        **options,
    )
    if checkpoint:
        shardwise.checkpoint_activations(model, block)
    opt = torch.optim.AdamW(model.parameters())
    rank = dist.get_rank()

    def step(i):
        x, y = tokens(i, rank)
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(0)
    shardwise.reset_comm_stats()
    with T.trace(model, opt) as t:
        for i in range(steps):
            step(i + 1)
    return model, opt, t


# --- the tracer
def tracer_facts():
    model, opt, t = traced_run(steps=2)
    held = shardwise.held_bytes(model, None)
    # the gradient shards a step leaves (padded, as the reduction's output is laid out)
    held["grads"] = sum(u.grad_layout.sizes[u.rank] * 4 for u in shardwise.units(model))
    data = t.data
    after = {
        "listeners": len(events.listeners),
        "modes": torch._C._len_torch_dispatch_stack(),
        "profiler": torch.autograd._profiler_enabled(),
        "root_hooks": len(model._forward_pre_hooks),
        "opt_hooks": len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks),
    }
    state_bytes = sum(
        v.numel() * v.element_size()
        for st in opt.state.values()
        for v in st.values()
        if torch.is_tensor(v)
    )
    return data, held, state_bytes, after, shardwise.comm_stats()


@pytest.fixture(scope="module")
def traced(pools):
    """Every rank's (trace, held bytes, optimizer state bytes, what is left installed, comm)."""
    return pools(2).run(tracer_facts)


def test_trace_records_every_unit_and_category(traced):
    data, _, _, after, stats = traced[0]
    assert after == {  # all removed
        "listeners": 0,
        "modes": 0,
        "profiler": False,
        "root_hooks": 1,
        "opt_hooks": 0,
    }
    assert data["format"] == T.FORMAT and data["world_size"] == 2 and len(data["ranks"]) == 2
    assert [u["name"] for u in data["units"]] == ["blocks.0", "blocks.1", "blocks.2", "<root>"]
    for r in data["ranks"]:
        assert len(r["steps"]) == 2
        spans = T.spans(r, data["units"])
        # forward and backward, 2 steps: every block is gathered twice a step
        for name, gathers in (("blocks.0", 2 * 2), ("blocks.2", 2 * 2)):
            mine = [s for s in spans if s["unit"] == name]
            assert sum(s["kind"] == "gather" for s in mine) == gathers
            assert sum(s["kind"] == "reduce" for s in mine) == 2
            assert {s["kind"] for s in mine if s["track"] == "compute"} == {"forward", "backward"}
        assert sum(s["kind"] == "optimizer" for s in spans) == 2
        assert all(s["end"] >= s["start"] for s in spans)
        for m in r["memory"]:
            assert m[1] == "cpu" and all(v >= 0 for v in m[2:])
        # after the last step all it allocated is freed again, wherever it was freed (the
        # last reference to a collective's buffers may go on the collective's worker thread)
        assert r["memory"][-1][2 + T.CATEGORIES.index("activations")] == 0
    summary = {s["rank"]: s for s in T.summary(data)}
    for rank, (_, held_r, state_r, _, _) in enumerate(traced):
        # model state at a step's end: what shardwise's accounting and the optimizer hold
        assert summary[rank]["model_state"] == held_r["params"] + held_r["grads"] + state_r
    per_step = sum(s.bytes for s in stats.values()) // 2
    assert per_step == sum(report.figures(data, 1)["sent"][0].values())


def late_release():
    """A backend that lets go of a finished collective's buffers late: Gloo's worker thread
    drops its reference some time after the wait returned (many milliseconds under load).
    Here a thread holds the root's reduce-scatter buffers for half a second past the wait."""
    model, opt, _ = traced_run(steps=1)
    root = shardwise.units(model)[-1]
    held = []

    def hold(name, unit, **fields):
        if name == "reduce_issue" and unit == "<root>":
            held.append(root._reduce.buffers)  # its buffers, as the backend's works hold them

    def step():
        x, y = tokens(9, dist.get_rank())
        model(x, y).backward()
        threading.Timer(0.5, held.clear).start()
        opt.step()
        opt.zero_grad(set_to_none=True)

    events.listen(hold)
    try:
        with T.trace(model, opt) as t:
            step()
    finally:
        events.unlisten(hold)
    return t.data["ranks"][dist.get_rank()]["memory"][-1][2 + T.CATEGORIES.index("activations")]


def test_trace_ends_after_the_backend_lets_go(pools):
    assert pools(2).run(late_release) == [0, 0]


def memtracker_peak(strategy):
    """Our peak and MemTracker's for one step, both watching the same step (MemTracker also
    handed no_shard's kept buckets, as the benchmark hands them: it misses them otherwise)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model, opt, _ = traced_run(strategy, steps=1)
    kept = kept_buckets(model)
    tracker = MemTracker()
    with warnings.catch_warnings():  # it warns about optimizer state entries that are None
        warnings.simplefilter("ignore")
        tracker.track_external(model, opt, *kept)
        with T.trace(model, opt) as t2, tracker:
            x, y = tokens(7, dist.get_rank())
            model(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    theirs = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return max(s["peak"] for s in T.summary(t2.data)), theirs, len(kept)


@pytest.mark.parametrize("strategy", ["full_shard", "no_shard"])
def test_tracer_peak_agrees_with_torch_memtracker(pools, strategy):
    ours, theirs, kept = pools(2).run(memtracker_peak, strategy)[0]
    assert kept == (4 if strategy == "no_shard" else 0)  # a bucket per unit: 3 blocks, the root
    assert ours == pytest.approx(theirs, rel=0.02)


def test_chrome_trace_is_well_formed(traced, tmp_path):
    data = traced[0][0]
    chrome = T.to_chrome(data)
    evs = chrome["traceEvents"]
    assert {e["ph"] for e in evs} == {"M", "X", "C"}
    assert {e["pid"] for e in evs} == {0, 1}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in evs if e["name"] == "thread_name"}
    assert {"compute", "all-gather", "reduce-scatter / all-reduce"} <= set(names.values())
    by_thread: dict = {}
    for e in evs:
        if e["ph"] == "X":
            by_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_thread.values():  # complete events on one thread nest properly
        stack: list[float] = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start + 1e-3:
                stack.pop()
            assert not stack or end <= stack[-1] + 1e-3
            stack.append(end)
    path = tmp_path / "t.chrome.json"
    path.write_text(json.dumps(chrome))
    assert json.loads(path.read_text())["displayTimeUnit"] == "ms"


def test_load_refuses_other_json(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a shardwise trace"):
        T.load(bad)


# --- the data the report is built from
def test_report_view_replays_the_step(traced):
    data = traced[0][0]
    view = report.build(data)
    assert view["step"] == 1 and view["steps"] == 2
    times = [e[0] for e in view["events"]]
    assert times == sorted(times) and times[0] >= 0 and max(times) <= view["duration"] + 1e-6
    for r in view["ranks"]:
        assert r["initial"] == ["sharded"] * 4  # between steps every unit is sharded
        assert all(0 <= s["start"] <= s["end"] <= view["duration"] + 1e-6 for s in r["spans"])
        assert r["lanes"]["gather"] >= 1
    # replaying the merged events leaves every unit sharded again, and gathers each block
    # twice (forward and backward) on each of the 2 ranks
    state = {(r["rank"], u): "sharded" for r in view["ranks"] for u in range(4)}
    gathers = 0
    for _, rank, name, unit, *_ in view["events"]:
        if name == "gather_issue":
            state[rank, unit] = "gathering"
            gathers += unit != 3
        elif name == "gather_done":
            state[rank, unit] = "gathered"
        elif name == "reshard":
            state[rank, unit] = "sharded"
    assert set(state.values()) == {"sharded"} and gathers == 2 * 2 * 3
    f = view["figures"]
    n, psi = 2, f["psi"]
    assert f["theory"]["all_gather"] == 2 * psi * 4 * (n - 1) // n
    for sent in f["sent"]:  # measured within padding and the root's single gather of theory
        total = sum(sent.values())
        assert 0.85 * sum(f["theory"].values()) <= total <= 1.05 * sum(f["theory"].values())
    assert f["model_state"][0] < f["ddp_model_state"] / 1.8
    html = report.render(view)
    assert "/*__SHARDWISE_DATA__*/" not in html and '"strategy":"full_shard"' in html
    with pytest.raises(ValueError, match="out of range"):
        report.build(data, step=5)


def test_report_command(traced, tmp_path):
    data = traced[0][0]
    src = tmp_path / "run.trace.json"
    src.write_text(json.dumps(data))
    report.main([str(src), "-o", str(tmp_path / "r.html"), "--chrome", str(tmp_path / "c.json")])
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")
    assert "traceEvents" in json.loads((tmp_path / "c.json").read_text())


# --- hybrid sharding: two kinds of collective on two links
def hybrid_tracer_facts():
    _, _, t = traced_run("hybrid_shard", steps=2, shard_size=2)
    return t.data, shardwise.comm_stats()


def test_hybrid_trace_shows_both_links(pools):
    out = pools(4).run(hybrid_tracer_facts)
    data = out[0][0]
    assert data["mesh"] == {"replicate": 2, "shard": 2}
    names = [u["name"] for u in data["units"]]
    for r in data["ranks"]:
        spans = T.spans(r, data["units"])
        # per unit and step: a reduce-scatter in the shard group, then an all-reduce of its
        # result across the replicas, issued later than the reduce-scatter
        for track in ("reduce", "replicate"):
            mine = [s for s in spans if s["track"] == track]
            assert sorted(s["unit"] for s in mine) == sorted(names * 2), track
            assert all(s["bytes"] > 0 and s["end"] >= s["start"] for s in mine)
        first = {s["unit"]: s["start"] for s in reversed(spans) if s["track"] == "reduce"}
        assert all(s["start"] >= first[s["unit"]] for s in spans if s["track"] == "replicate")
    f = report.figures(data, 1)
    psi, b, s, r = f["psi"], 4, 2, 2
    assert f["theory"]["all_gather"] == 2 * psi * b * (s - 1) // s
    assert f["theory"]["reduce_scatter"] == psi * b * (s - 1) // s
    assert f["theory"]["replicate_all_reduce"] == 2 * psi * b * (r - 1) // (r * s)
    links = f["links"]
    for rank, (_, stats) in enumerate(out):
        sent = f["sent"][rank]  # the step's bytes, each kind over its own group's size
        for kind in ("all_gather", "reduce_scatter", "replicate_all_reduce", "step_check"):
            assert sent[kind] == stats[kind].bytes // 2, (rank, kind)  # two identical steps
        assert links["within"][rank] == sent["all_gather"] + sent["reduce_scatter"]
        assert links["across"][rank] == sent["replicate_all_reduce"]
        # within padding rows of the theory (and the kept units' single gathers, within)
        across = links["theory_across"]
        assert across <= links["across"][rank] <= 1.05 * across
        assert 0.8 * links["theory_within"] <= links["within"][rank] <= 1.05 * links["theory_within"]
    view = report.build(data)
    assert view["mesh"] == data["mesh"] and "2 replicas x 2 shards" in view["title"]
    assert all(rv["lanes"]["replicate"] >= 1 for rv in view["ranks"])
    threads = {e["args"]["name"] for e in T.to_chrome(data)["traceEvents"] if e["name"] == "thread_name"}
    assert "all-reduce across replicas" in threads
