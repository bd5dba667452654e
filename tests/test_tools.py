"""Planner, tracer, Chrome export and the data the report is built from.

The planner's honesty test compares its prediction with what the tracer measures on real
runs of the built-in GPT (N = 1, 2, 4 on CPU); the tracer itself is checked against torch's
MemTracker and against shardwise's own accounting, so the measurement is not the planner's
arithmetic in disguise.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise import events
from shardwise.models import GPT, Block, gpt_config
from shardwise.tools import plan as P
from shardwise.tools import report
from shardwise.tools import trace as T
from shardwise.tools.accounting import kept_buckets

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
    strategy="full_shard", wrap=True, precision=None, offload=False, checkpoint=False, steps=2
):
    """Build the GPT, take one untraced step (the optimizer state appears), trace ``steps``."""
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


# --- the planner against measurement
HONESTY = {  # world size -> (strategy, wrap by block, mixed precision, offload, checkpointing)
    1: [("full_shard", True, None, False, False)],
    2: [
        ("full_shard", True, None, False, False),
        ("shard_grad_op", True, None, False, False),
        ("no_shard", True, None, False, False),
        ("full_shard", True, None, False, True),
        ("full_shard", True, "bf16", False, False),
        ("full_shard", True, None, True, False),
    ],
    4: [
        ("full_shard", True, None, False, False),
        ("full_shard", False, None, False, False),
        ("shard_grad_op", True, "bf16", False, True),
    ],
}


def measure(configs):
    out = []
    for strategy, wrap, precision, offload, checkpoint in configs:
        _, _, t = traced_run(strategy, wrap, precision, offload, checkpoint, steps=1)
        rows = T.summary(t.data)
        out.append(
            (
                max(r["peak"] for r in rows),
                max(r["model_state"] for r in rows),
                shardwise.comm_stats(),
            )
        )
    return out


def predict(world, strategy, wrap, precision, offload, checkpoint):
    block = shardwise.wrap.by_class(Block)
    e = P.plan(
        gpt,
        world_size=world,
        strategy=strategy,
        wrap=block if wrap else None,
        mixed_precision=precision,
        cpu_offload=offload,
        activation_checkpointing=block if checkpoint else None,
        batch_size=BATCH,
        seq_len=CFG["seq_len"],
    ).estimates[0]
    # on CPU, host and device are one memory: with offload, the host part is held throughout
    total = max(e.peak + (e.param_shards + e.optimizer if offload else 0), e.host)
    return e, total


@pytest.mark.parametrize("world", [1, 2, 4])
def test_planner_matches_measured_peak(pools, world):
    measured = pools(world).run(measure, HONESTY[world])[0]
    errors = []
    for config, (peak, state, stats) in zip(HONESTY[world], measured):
        e, total = predict(world, *config)
        errors.append((config, (total - peak) / peak, (e.model_state - state) / state))
        assert abs(e.model_state - state) <= 0.10 * state, (config, e.model_state, state)
        assert abs(total - peak) <= 0.20 * peak, (config, total, peak)
        for kind, sent in e.comm.items():  # bytes per step: exactly what the collectives booked
            assert sent == stats[kind].bytes, (config, kind, sent, stats[kind].bytes)
    print(
        "\nplanner error at N =",
        world,
        *(f"\n  {c}: total {a:+.2%}, model state {b:+.2%}" for c, a, b in errors),
    )


def test_planner_forms_units_as_shard_does(pools):
    real = pools(2).run(_units_of_real)[0]
    planned = P.plan(
        gpt,
        world_size=2,
        strategy="full_shard",
        wrap=shardwise.wrap.by_class(Block),
        batch_size=1,
        seq_len=8,
    )
    assert [(u.name, u.shard_bytes, u.gathered_bytes) for u in planned.estimates[0].units] == real


def _units_of_real():
    model, _, _ = traced_run(steps=1)
    return [
        (u.label, u.flat_shard.numel() * 4, u.layout.unsharded_numel * 4)
        for u in shardwise.units(model)
    ]


def test_planner_needs_no_group_and_leaves_a_module_alone():
    assert not dist.is_initialized()
    model = gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    p = P.plan(model, world_size=4, wrap=shardwise.wrap.by_class(Block), batch_size=2)
    assert [e.strategy for e in p.estimates] == list(P.STRATEGIES)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert model.lm_head.weight is model.tok_emb.weight and all(
        p.grad is None for p in model.parameters()
    )
    full, grad_op, ddp = p.estimates
    assert full.model_state * 4 == pytest.approx(ddp.model_state, rel=0.02)  # 1/N, plus padding
    assert full.gathered_peak < grad_op.gathered_peak  # full_shard frees each block after use
    assert full.comm["all_gather"] > grad_op.comm["all_gather"] > 0 == ddp.comm["all_gather"]
    assert "full_shard" in str(p) and "predicted peak" in str(p) and "micro-batch 2 x 64" in str(p)


def test_checkpointing_and_precision_lower_the_prediction():
    block = shardwise.wrap.by_class(Block)
    base = P.plan(gpt, strategy="full_shard", wrap=block, batch_size=BATCH).estimates[0]
    ckpt = P.plan(
        gpt, strategy="full_shard", wrap=block, activation_checkpointing=block, batch_size=BATCH
    ).estimates[0]
    bf16 = P.plan(
        gpt, strategy="full_shard", wrap=block, mixed_precision="bf16", batch_size=BATCH
    ).estimates[0]
    assert ckpt.activations * 2 < base.activations and ckpt.peak < base.peak
    assert (
        bf16.activations < base.activations and bf16.model_state == base.model_state
    )  # fp32 master


def test_offload_moves_model_state_to_the_host():
    e = P.plan(
        gpt,
        world_size=2,
        strategy="full_shard",
        wrap=shardwise.wrap.by_class(Block),
        cpu_offload=True,
        batch_size=BATCH,
    ).estimates[0]
    on = P.plan(
        gpt,
        world_size=2,
        strategy="full_shard",
        wrap=shardwise.wrap.by_class(Block),
        batch_size=BATCH,
    ).estimates[0]
    assert e.host >= e.model_state and on.host == 0
    assert e.peak < on.peak - e.optimizer // 2
    with pytest.raises(shardwise.ShardwiseError, match="sharded strategy"):
        P.plan(gpt, strategy="no_shard", cpu_offload=True, batch_size=1)


def test_budget_picks_the_cheapest_that_fits():
    block = shardwise.wrap.by_class(Block)
    roomy = P.plan(gpt, world_size=2, wrap=block, batch_size=BATCH, budget="1GiB")
    assert roomy.choice.strategy == "no_shard" and not roomy.choice.activation_checkpointing
    every = {e.label: e.peak for e in roomy.estimates}
    # a budget just under DDP's peak: it must shard, and say why not DDP
    tight = P.plan(
        gpt, world_size=2, wrap=block, batch_size=BATCH, budget=every["no_shard (DDP)"] - 1
    )
    assert tight.choice.strategy != "no_shard" and tight.choice.peak < every["no_shard (DDP)"]
    assert "no_shard (DDP) needs" in tight.reason and "fits" in tight.reason
    smallest = min(every.values())
    assert (
        P.plan(gpt, world_size=2, wrap=block, batch_size=BATCH, budget=smallest).choice.peak
        == smallest
    )
    none = P.plan(gpt, world_size=2, wrap=block, batch_size=BATCH, budget=smallest - 1)
    assert none.choice is None and "nothing fits" in none.reason


def test_budget_strings():
    assert P.parse_bytes("24GiB") == 24 * 2**30
    assert P.parse_bytes("1.5 GB") == 1_500_000_000
    assert P.parse_bytes(123) == 123
    with pytest.raises(shardwise.ShardwiseError, match="24GiB"):
        P.parse_bytes("lots")
    with pytest.raises(shardwise.ShardwiseError, match="strategy"):
        P.plan(gpt, strategy="zero3")


def test_plan_command(capsys):
    P.main(
        [
            "--model-size",
            "tiny",
            "--world-size",
            "2",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--budget",
            "64MiB",
        ]
    )
    out = capsys.readouterr().out
    assert "blocks.0" in out and "predicted peak" in out and "budget 64.00 MiB: choose" in out


# --- the tracer
def tracer_facts():
    model, opt, t = traced_run(steps=2)
    held = shardwise.held_bytes(model, None)
    # the gradient shards a step leaves (padded, as the reduction's output is laid out)
    held["grads"] = sum(u.grad_layout.shard_numel * 4 for u in shardwise.units(model))
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
