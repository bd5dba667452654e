"""The benchmark harness end to end on a tiny GPT: every system runs the same work, counted
bytes equal the theory, and the table, JSON and PNG are written (no timing is asserted)."""

import json

import pytest
import torch

from shardwise.bench import harness as bench


def test_bench_runs_every_system(pools, tmp_path):
    cfg = bench.BenchConfig(
        model="tiny", batch_size=2, seq_len=32, rounds=1, steps=1, quiet=1.0, out=str(tmp_path)
    )
    summary = bench.summarize(cfg, pools(2).run(bench.run_rank, cfg)[0])
    bench.report(summary, cfg.out)

    rows = summary["systems"]
    assert list(rows) == list(bench.SYSTEMS)
    assert summary["loss_check"]["ok"], summary["loss_check"]
    for name, r in rows.items():
        assert r["bytes_per_step"] == r["theory_bytes"], (name, r["bytes_by_kind"])
        assert r["unknown_collectives"] == [], name
        assert r["peak_bytes"] > 0, name
        assert len(r["step_ms"]) == 1 and r["median_ms"] > 0 and r["redone_visits"] == 0
    own = rows["shardwise/full_shard"]
    # the counter sees the step check (an all-reduce); on Gloo our gathers and reduce-scatters
    # are messages the posting thread posts, out of its sight: they come from our own books
    ours, counted = own["shardwise_comm_stats_bytes"], own["bytes_by_kind"]
    assert counted == {
        "all_gather": ours["all_gather"],
        "reduce_scatter": ours["reduce_scatter"],
        "all_reduce": ours["step_check"],
    }
    assert rows["floor"]["x_floor"] == 1.0 and own["x_fsdp2"] > 0 and own["x_ddp"] > 0

    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["systems"].keys() == rows.keys()
    md = (tmp_path / "bench.md").read_text()
    assert all(f"| {name} |" in md for name in bench.SYSTEMS)
    png = (tmp_path / "bench.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and png[12:16] == b"IHDR"


def test_mlp_workload_splits_one_global_batch():
    cfg = bench.BenchConfig(model="mlp", batch_size=3, steps=1, warmup=1)
    ranks = [bench.workload(cfg, r, 2, torch.device("cpu")) for r in range(2)]
    assert ranks[0].num_params == 8 * (1024 * 1024 + 1024) and ranks[0].root_params == 0
    assert ranks[0].tokens_per_step == 6 and len(ranks[0].batches) == 2
    x0, x1 = (w.batches[0][0] for w in ranks)
    assert x0.shape == (3, 1024) and not torch.equal(x0, x1)  # two halves of one batch


def test_config_rejects_unknown_systems():
    with pytest.raises(ValueError, match="unknown systems"):
        bench.parse_args(["--systems", "floor,megatron"])


def test_strategy_picks_the_systems_to_compare():
    cfg = bench.parse_args(["--strategy", "hybrid_shard", "--shard-size", "2"])
    assert cfg.systems == ("floor", "ddp", "fsdp2/hybrid_shard", "shardwise/hybrid_shard")
    assert bench.parse_args(["--strategy", "no_shard"]).systems == ("floor", "ddp", "shardwise/no_shard")
    assert bench.parse_args([]).systems == bench.SYSTEMS
    with pytest.raises(SystemExit):
        bench.parse_args(["--strategy", "full_shard", "--systems", "floor"])


def test_a_bad_link_rate_is_named_before_any_namespace(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--nodes", "2", "--link", "1gigabit"])
    assert "'1gigabit' is not a link rate tc takes" in capsys.readouterr().err


def test_bench_hybrid_against_fsdp2_hsdp_on_the_same_mesh(pools, tmp_path):
    argv = ["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--rounds", "1", "--steps", "1"]
    cfg = bench.parse_args(argv + ["--quiet", "1", "--strategy", "hybrid_shard", "--shard-size", "2"])
    summary = bench.summarize(cfg, pools(4).run(bench.run_rank, cfg)[0])
    bench.report(summary, str(tmp_path))
    rows = summary["systems"]
    assert summary["mesh"] == [2, 2] and summary["loss_check"]["ok"], summary["loss_check"]
    for name, r in rows.items():
        assert r["bytes_per_step"] == r["theory_bytes"], (name, r["bytes_by_kind"])
        assert r["unknown_collectives"] == [] and r["peak_bytes"] > 0, name
    own, hsdp = rows["shardwise/hybrid_shard"], rows["fsdp2/hybrid_shard"]
    # the counter sees the replicate all-reduce and the step check (all-reduces); our gathers
    # and reduce-scatters within the shard group (posted messages) come from our own books
    ours, counted = own["shardwise_comm_stats_bytes"], own["bytes_by_kind"]
    assert counted == {
        "all_gather": ours["all_gather"],
        "reduce_scatter": ours["reduce_scatter"],
        "all_reduce": ours["replicate_all_reduce"] + ours["step_check"],
    }
    # across the replicas both move the same bytes: each rank's reduced shard, all-reduced
    assert counted["all_reduce"] - ours["step_check"] == hsdp["bytes_by_kind"]["all_reduce"]
    assert own["x_fsdp2"] > 0 and "| shardwise/hybrid_shard |" in (tmp_path / "bench.md").read_text()


def compiled_blocks_per_system(argv):
    """Build every system as ``--compile`` does; per system, its blocks and how many are compiled."""
    cfg = bench.parse_args(argv)
    work = bench.workload(cfg, torch.distributed.get_rank(), 2, torch.device("cpu"))
    meshes = bench.device_meshes(cfg, torch.device("cpu"))
    out = {}
    for name in cfg.systems:
        model = bench.build_system(name, cfg, work, torch.device("cpu"), meshes)[0]
        blocks = [m for m in model.modules() if isinstance(m, work.block)]
        out[name] = (len(blocks), sum(m._compiled_call_impl is not None for m in blocks))
    return out


def test_compile_flag_compiles_every_block_of_every_system(pools):
    argv = ["--model", "tiny", "--compile"]
    got = pools(2).run(compiled_blocks_per_system, argv)[0]
    assert set(got) == set(bench.SYSTEMS)
    assert all(n == 2 and compiled == n for n, compiled in got.values()), got  # tiny: 2 blocks
    plain = pools(2).run(compiled_blocks_per_system, argv[:2])[0]
    assert all(compiled == 0 for _, compiled in plain.values())
