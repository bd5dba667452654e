"""Checkpoints: exact resume, resharding to other world sizes, wraps and strategies (hybrid
meshes too), crash safety, named errors, conversion to standard safetensors, background saves,
O(shard) loads."""

import json
import os
import shutil
import signal
import time

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.nn as nn
from nets import batch, global_mean, local_slice, loss_of, make, wrap_policy
from pool import WorkerPool

import shardwise
from shardwise import checkpoint as ckpt
from shardwise.checkpoint import CheckpointError, commit, saving

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks


def sharded(kind, wrap="by_class", strategy="full_shard", seed=0, buffers=False, **options):
    model = make(kind, seed)
    if buffers:
        model.register_buffer("counts", torch.arange(7.0) + seed)
        model.layers[0].register_buffer("scratch", torch.full((3,), float(seed)), persistent=False)
    return shardwise.shard(model, wrap=wrap_policy(wrap, kind), strategy=strategy, **options)


def adamw(model, lr=1e-2):
    return torch.optim.AdamW(model.parameters(), lr=lr)


def train(kind, model, opt, start, stop, noise=False):
    """Steps ``start..stop-1`` on fixed global batches; returns the global mean losses."""
    losses = []
    for step in range(start, stop):
        x, y = batch(kind, step, GLOBAL_BATCH)
        x, y = local_slice(x), local_slice(y)
        if noise:  # draws from the global RNG, so an exact resume needs the RNG restored
            x = x + 0.05 * torch.randn(x.shape)
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
    return losses


# --- resume is bitwise exact at the same world size (fp32)
def straight_run(steps, options=None):
    torch.manual_seed(100 + dist.get_rank())
    model = sharded("mlp", **(options or {}))
    opt = adamw(model)
    losses = train("mlp", model, opt, 0, steps, noise=True)
    return losses, shardwise.full_state_dict(model)


def first_half(path, steps, options=None):
    torch.manual_seed(100 + dist.get_rank())
    model = sharded("mlp", **(options or {}))
    opt = adamw(model)
    losses = train("mlp", model, opt, 0, steps, noise=True)
    ckpt.save(path, model, opt, step=steps, extra={"next_batch": steps})
    return losses


def second_half(path, steps, options=None):
    torch.manual_seed(12345)  # wrong on purpose: load must restore each rank's RNG
    model = sharded("mlp", seed=9, **(options or {}))  # other initial values, which load must overwrite
    opt = adamw(model, lr=0.5)  # other hyper-parameters too
    info = ckpt.load(path, model, opt)
    start = info.extra["next_batch"]
    losses = train("mlp", model, opt, start, start + steps, noise=True)
    return info, losses, shardwise.full_state_dict(model)


@pytest.fixture(scope="module")
def own_pool():
    """Processes apart from the shared pools: new ones for a resume, and ones that the crash
    tests kill (with a short collective timeout, for the survivors)."""
    pool = WorkerPool(2, timeout=60, group_timeout=3)
    yield pool
    pool.close()


def test_resume_is_bitwise_exact(pools, own_pool, tmp_path):
    path = tmp_path / "step-6"
    losses, final = pools(2).run(straight_run, 12)[0]
    assert pools(2).run(first_half, path, 6)[0] == losses[:6]
    info, resumed, resumed_final = own_pool.run(second_half, path, 6)[0]  # other processes
    assert (info.step, info.extra, info.world_size, info.strategy) == (
        6,
        {"next_batch": 6},
        2,
        "full_shard",
    )
    assert info.rng_restored
    assert resumed == losses[6:]  # exact float equality, step by step
    assert final.keys() == resumed_final.keys()
    for k in final:
        assert torch.equal(final[k], resumed_final[k]), k


# --- resharding: save at N=4, load at N=1, 2, 3 with other wraps and strategies
def reshard_source(path, **options):
    """Train 4 steps, save, train 3 more: the saved values, the losses after, the final values."""
    model = sharded("tied", **options)
    opt = adamw(model)
    train("tied", model, opt, 0, 4)
    ckpt.save(path, model, opt, step=4)
    saved = shardwise.full_state_dict(model)
    losses = train("tied", model, opt, 4, 7)
    return saved, losses, shardwise.full_state_dict(model)


@pytest.fixture(scope="module")
def source(pools, tmp_path_factory):
    """A checkpoint of the tied transformer saved at N=4, and how training went on from it."""
    path = tmp_path_factory.mktemp("reshard") / "step-4"
    saved, losses, final = pools(4).run(reshard_source, path)[0]
    return path, saved, losses, final


def reshard_target(path, wrap, strategy, options=None):
    model = sharded("tied", wrap, strategy, seed=3, **(options or {}))
    opt = adamw(model, lr=0.1)
    info = ckpt.load(path, model, opt)
    loaded = shardwise.full_state_dict(model)
    losses = train("tied", model, opt, 4, 7)
    return info, loaded, losses, shardwise.full_state_dict(model)


@pytest.mark.parametrize(
    "world_size, wrap, strategy, options",
    [
        (1, "by_class", "full_shard", {}),
        (2, "none", "no_shard", {}),
        (3, "by_size", "shard_grad_op", {}),
        (3, "by_class", "full_shard", {}),
        # into hybrid meshes at the saved world size: 2x2, and the degenerate 4x1 and 1x4
        (4, "by_class", "hybrid_shard", {"shard_size": 2}),
        (4, "by_size", "hybrid_shard_grad_op", {"shard_size": 1}),
        (4, "by_class", "hybrid_shard", {"shard_size": 4}),
    ],
)
def test_load_at_another_world_size_wrap_and_strategy(
    pools, source, world_size, wrap, strategy, options
):
    path, saved, losses, final = source
    info, loaded, got_losses, got_final = pools(world_size).run(
        reshard_target, path, wrap, strategy, options
    )[0]
    assert (info.world_size, info.step, info.rng_restored) == (4, 4, world_size == 4)
    assert loaded.keys() == saved.keys()
    for k in saved:
        assert torch.equal(loaded[k], saved[k]), k
    for step, (a, b) in enumerate(zip(got_losses, losses)):
        assert a == pytest.approx(b, rel=1e-5), f"step {4 + step}"
    assert max((got_final[k] - final[k]).abs().max().item() for k in final) <= 1e-5


def test_tied_parameters_are_stored_once(source):
    path = source[0]
    index = json.loads((path / "index.json").read_text())
    emb = index["tensors"]["emb.weight"]
    assert emb["aliases"] == ["head.weight"] and "head.weight" not in index["tensors"]
    assert [p["rows"] for p in emb["pieces"]] == [[0, 6], [6, 12], [12, 18], [18, 23]]
    stored = set()
    for name in index["files"]:
        with safetensors.safe_open(path / name, "pt") as f:
            stored.update(f.keys())
    assert "head.weight" not in stored and "emb.weight" in stored
    assert index["world_size"] == 4 and index["strategy"] == "full_shard" and index["step"] == 4
    assert all(len(v["crc32"]) == 8 for v in index["files"].values())


# --- hybrid sharding: the first replica writes each row once; any layout loads it
@pytest.fixture(scope="module")
def hybrid_source(pools, tmp_path_factory):
    """A checkpoint of the tied transformer saved under hybrid_shard on a 2x2 mesh (replicas x
    shard) at N=4, and how training went on from it."""
    path = tmp_path_factory.mktemp("hybrid") / "step-4"
    saved, losses, final = pools(4).run(reshard_source, path, strategy="hybrid_shard", shard_size=2)[0]
    return path, saved, losses, final


def hybrid_save(path, shard_size):
    model = sharded("tied", strategy="hybrid_shard", shard_size=shard_size)
    opt = adamw(model)
    train("tied", model, opt, 0, 1)
    ckpt.save(path, model, opt, step=1)


@pytest.mark.parametrize("shard_size", [1, 2, 4])
def test_hybrid_save_writes_each_row_once(pools, hybrid_source, tmp_path, shard_size):
    path = hybrid_source[0] if shard_size == 2 else tmp_path / "c"
    if shard_size != 2:
        pools(4).run(hybrid_save, path, shard_size)
    index = json.loads((path / "index.json").read_text())
    assert index["world_size"] == 4 and index["strategy"] == "hybrid_shard"
    writers = {f"rank-{r:05d}-of-00004.safetensors" for r in range(shard_size)}  # replica 0
    for name, t in index["tensors"].items():
        assert {p["file"] for p in t["pieces"]} <= writers, name
    rows = -(-23 // shard_size)  # emb.weight: 23 rows in shard_size pieces, each once
    starts = range(0, 23, rows)
    assert [p["rows"] for p in index["tensors"]["emb.weight"]["pieces"]] == [
        [a, min(a + rows, 23)] for a in starts
    ]
    stored = {}
    for name in index["files"]:
        with safetensors.safe_open(path / name, "pt") as f:
            stored[name] = set(f.keys())
    assert len(stored) == 4 and [e["file"] for e in index["rng"]] == sorted(stored)
    for name, keys in stored.items():  # the other replicas' files: their RNG states alone
        assert (keys != {"rng.cpu"}) == (name in writers), (name, keys)


def check_resharded(source, got):
    saved, losses, final = source[1:]
    info, loaded, got_losses, got_final = got
    assert info.step == 4 and loaded.keys() == saved.keys()
    for k in saved:
        assert torch.equal(loaded[k], saved[k]), k
    for step, (a, b) in enumerate(zip(got_losses, losses)):
        assert a == pytest.approx(b, rel=1e-5), f"step {4 + step}"
    assert max((got_final[k] - final[k]).abs().max().item() for k in final) <= 1e-5


@pytest.mark.parametrize(
    "world_size, wrap, strategy, options",
    [
        (1, "by_class", "full_shard", {}),
        (2, "none", "no_shard", {}),
        (3, "by_size", "shard_grad_op", {}),
        (4, "by_class", "hybrid_shard", {"shard_size": 1}),  # 4x1
        (4, "by_size", "hybrid_shard_grad_op", {"shard_size": 4}),  # 1x4
        (2, "by_class", "hybrid_shard", {"shard_size": 1}),  # 2x1, at another world size
    ],
)
def test_hybrid_checkpoint_loads_into_any_layout(
    pools, hybrid_source, world_size, wrap, strategy, options
):
    got = pools(world_size).run(reshard_target, hybrid_source[0], wrap, strategy, options)[0]
    assert (got[0].world_size, got[0].strategy, got[0].rng_restored) == (
        4,
        "hybrid_shard",
        world_size == 4,
    )
    check_resharded(hybrid_source, got)


def test_hybrid_resume_is_bitwise_exact(pools, tmp_path):
    options = {"strategy": "hybrid_shard", "shard_size": 2}
    losses, final = pools(4).run(straight_run, 8, options)[0]
    assert pools(4).run(first_half, tmp_path / "c", 4, options)[0] == losses[:4]
    info, resumed, resumed_final = pools(4).run(second_half, tmp_path / "c", 4, options)[0]
    assert info.rng_restored  # each rank's, the other replicas' too
    assert resumed == losses[4:]  # exact float equality, step by step
    for k in final:
        assert torch.equal(final[k], resumed_final[k]), k


def hybrid_exports(path):
    """Full state dicts, a Hugging Face style export and loads from it under hybrid 2x2:
    what each rank gathered, and whether every value is right."""
    model = sharded("tied", strategy="hybrid_shard", shard_size=2)
    opt = adamw(model)
    train("tied", model, opt, 0, 2)
    shardwise.reset_comm_stats()
    full = shardwise.full_state_dict(model)
    gathers = [shardwise.comm_stats(reset=True)["all_gather"].calls]
    ckpt.save_pretrained(model, path)
    gathers.append(shardwise.comm_stats(reset=True)["all_gather"].calls)
    everywhere = shardwise.full_state_dict(model, rank0_only=False)
    a = sharded("tied", "by_size", "hybrid_shard", seed=5, shard_size=2)
    ckpt.load_full(a, path)
    b = sharded("tied", "by_class", "hybrid_shard", seed=6, shard_size=1)
    shardwise.load_full_state_dict(b, full if dist.get_rank() == 0 else None)
    loaded = [shardwise.full_state_dict(m, rank0_only=False) for m in (a, b)]
    return dist.get_rank(), gathers, full, everywhere, loaded


def test_hybrid_full_state_dict_and_exports_gather_on_one_replica(pools, tmp_path):
    out = pools(4).run(hybrid_exports, tmp_path / "hf")
    full = out[0][2]
    units = 4  # three blocks and the root
    for rank, gathers, mine, everywhere, loaded in out:
        # rank 0's shard group gathers; the other replica holds the same rows and does not
        assert gathers == ([units, units] if rank < 2 else [0, 0]), rank
        assert (mine.keys() == full.keys()) if rank == 0 else mine == {}
        for sd in (everywhere, *loaded):
            assert sd.keys() == full.keys() and all(torch.equal(sd[k], full[k]) for k in full)
    exported = safetensors.torch.load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == full.keys() - {"head.weight"}  # tied: stored once
    assert all(torch.equal(exported[k], full[k]) for k in exported)


# --- frozen parameters, 0-dim parameters and buffers survive a round trip
def frozen_save(path):
    # no_shard: each rank holds whole tensors and saves 1/N of their rows
    model = sharded("mlp", strategy="no_shard", buffers=True)
    opt = adamw(model)
    train("mlp", model, opt, 0, 2)
    ckpt.save(path, model, opt)
    return shardwise.full_state_dict(model)


def frozen_load(path):
    model = sharded("mlp", "by_size", seed=4, buffers=True)
    opt = adamw(model)
    ckpt.load(path, model, opt)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    return shardwise.full_state_dict(model), frozen, model.layers[0].scratch.tolist()


def test_frozen_parameters_and_buffers_round_trip(pools, tmp_path):
    saved = pools(3).run(frozen_save, tmp_path / "c")[0]
    loaded, frozen, scratch = pools(2).run(frozen_load, tmp_path / "c")[0]
    assert frozen == ["layers.1.lin.weight", "layers.1.lin.bias"]
    assert "counts" in loaded and "layers.0.scratch" not in loaded and scratch == [4.0] * 3
    for k in saved:
        assert torch.equal(loaded[k], saved[k]), k
    initial = make("mlp", seed=4).state_dict()  # what the loading model started from
    assert not torch.equal(saved["layers.1.lin.weight"], initial["layers.1.lin.weight"])
    assert saved["gain"].shape == () and torch.equal(saved["counts"], torch.arange(7.0))


# --- a rank killed at any moment of a save: the previous checkpoint stays, latest() skips it
def save_and_die(root, when):
    model = sharded("tied")
    opt = adamw(model)
    train("tied", model, opt, 0, 1)
    ckpt.save(root / "step-1", model, opt, step=1)
    train("tied", model, opt, 1, 2)
    # rank 1 once its file is written; rank 0 once the marker is (the directory not yet renamed)
    die_after = {
        "data file": (1, saving, "_write_rank_file"),
        "marker": (0, commit, "write_marker"),
    }
    rank, module, name = die_after[when]
    if dist.get_rank() == rank:
        original = getattr(module, name)

        def then_die(*args, **kwargs):
            original(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)

        setattr(module, name, then_die)
    ckpt.save(root / "step-2", model, opt, step=2)


def load_step(path):
    model = sharded("tied")
    return ckpt.load(path, model, adamw(model)).step


@pytest.mark.parametrize("when", ["data file", "marker"])
def test_rank_killed_during_save(own_pool, pools, tmp_path, when):
    out = own_pool.run_outcomes(save_and_die, tmp_path, when)
    killed = 1 if when == "data file" else 0
    assert out[killed].exitcode == -signal.SIGKILL
    survivor = out[1 - killed]
    assert (
        survivor.error_type.endswith("CheckpointError")
        and "did not complete" in survivor.error_message
    )
    assert not (tmp_path / "step-2").exists()
    assert [p.name for p in tmp_path.glob("step-2.tmp-*")]  # the half-written save, left aside
    assert ckpt.latest(tmp_path) == tmp_path / "step-1"
    assert pools(2).run(load_step, tmp_path / "step-1") == [1, 1]


def test_latest_picks_the_newest_complete(tmp_path):
    assert ckpt.latest(tmp_path / "nowhere") is None
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        crc = commit.write_index(
            tmp_path / name, ckpt.index.Index(1, "full_shard", None, None, {}, {}, None, [])
        )
        if name != "c":
            commit.write_marker(tmp_path / name, crc)
        time.sleep(0.01)
    assert ckpt.latest(tmp_path) == tmp_path / "b"  # c has no marker
    (tmp_path / "b" / "index.json").write_text("{}")  # no longer matches its marker
    assert ckpt.latest(tmp_path) == tmp_path / "a"


# --- damaged checkpoints and mismatched models: named errors, nothing half-loaded
def try_load(path, case):
    if case == "other model":
        model = sharded("tied")
    elif case == "shape":
        m = make("mlp")
        m.out = nn.Linear(2, 4)
        model = shardwise.shard(m, wrap=wrap_policy("by_class", "mlp"))
    elif case == "dtype":
        model = shardwise.shard(make("mlp").double(), wrap=wrap_policy("by_class", "mlp"))
    else:
        model = sharded("mlp", seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if case == "optimizer" else adamw(model)
    before = shardwise.full_state_dict(model, rank0_only=False)
    try:
        ckpt.load(path, model, opt)
    except CheckpointError as e:
        after = shardwise.full_state_dict(model, rank0_only=False)
        return str(e), all(torch.equal(before[k], after[k]) for k in before), len(opt.state)
    return None


def damage(src, dst, case):
    shutil.copytree(src, dst)
    victim = dst / "rank-00001-of-00002.safetensors"
    if case == "corrupt":
        data = bytearray(victim.read_bytes())
        data[-20] ^= 0xFF
        victim.write_bytes(bytes(data))
    elif case == "truncated":
        victim.write_bytes(victim.read_bytes()[:-100])
    elif case == "missing":
        victim.unlink()
    elif case == "no marker":
        (dst / "COMMITTED").unlink()
    elif case == "index edited":
        (dst / "index.json").write_text(
            (dst / "index.json").read_text().replace('"step": null', '"step": 3')
        )


@pytest.mark.parametrize(
    "case, expected",
    [
        ("corrupt", ["rank-00001-of-00002.safetensors is corrupt", "CRC-32"]),
        ("truncated", ["rank-00001-of-00002.safetensors has", "truncated"]),
        ("missing", ["rank-00001-of-00002.safetensors is missing"]),
        ("no marker", ["not a complete checkpoint", "COMMITTED"]),
        ("index edited", ["index.json does not match", "corrupt"]),
        (
            "other model",
            [
                "parameters missing from the checkpoint: 'pos', 'emb.weight'",
                "parameters in the checkpoint that the model does not have: "
                "'gain' (file rank-00000-of-00002.safetensors), 'shift'",
            ],
        ),
        (
            "shape",
            [
                "tensor 'out.weight' has shape [3, 2] in the checkpoint (files "
                "rank-00000-of-00002.safetensors, rank-00001-of-00002.safetensors); "
                "the model needs [4, 2]"
            ],
        ),
        (
            "dtype",
            [
                "tensor 'gain' is torch.float32 in the checkpoint "
                "(file rank-00000-of-00002.safetensors); the model needs torch.float64"
            ],
        ),
        ("optimizer", ["the checkpoint's optimizer is AdamW, this one is SGD"]),
    ],
)
def test_damaged_or_mismatched_checkpoints_raise_named_errors(pools, tmp_path, case, expected):
    pools(2).run(frozen_save, tmp_path / "good")
    damage(tmp_path / "good", tmp_path / "bad", case)
    for result in pools(2).run(
        try_load, tmp_path / "bad", case
    ):  # every rank raises, even one that reads no damaged file
        assert result is not None, "load did not raise"
        msg, unchanged, opt_state = result
        for text in expected:
            assert text in msg, msg
        assert unchanged and opt_state == 0  # nothing was half-loaded


def refused(path, extra):
    model = sharded("mlp")
    try:
        ckpt.save(path, model, extra=extra)
    except CheckpointError as e:
        return str(e)


def test_save_refuses_what_it_cannot_store_or_replace(pools, tmp_path):
    for msg in pools(2).run(refused, tmp_path / "x", {"not json": object()}):
        assert "refused, nothing was written" in msg and "extra must be JSON-serialisable" in msg
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "mine").mkdir()
    for msg in pools(2).run(refused, tmp_path / "mine", None):
        assert "mine exists and is not a checkpoint: refusing to replace it" in msg
    pools(2).run(refused, tmp_path / "ckpt", 1)
    pools(2).run(refused, tmp_path / "ckpt", 2)  # a checkpoint is replaced
    assert json.loads((tmp_path / "ckpt" / "index.json").read_text())["extra"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "mine"]


def two_optimizers_over_one_parameter(path):
    """A DiLoCo-like pair (inner and outer over the same parameters) in one checkpoint."""
    model = sharded("mlp")
    inner, outer = adamw(model), torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9)
    train("mlp", model, inner, 0, 1)
    outer.zero_grad(set_to_none=False)
    outer.step()  # both now hold state for every parameter
    try:
        ckpt.save(path, model, [inner, outer])
    except CheckpointError as e:
        return str(e)


def test_two_optimizers_over_one_parameter_are_refused(pools, tmp_path):
    """Optimizer state is keyed by parameter: two optimizers over one parameter would mix
    their states (AdamW's and SGD's) in one checkpoint, silently."""
    for msg in pools(2).run(two_optimizers_over_one_parameter, tmp_path / "x"):
        assert msg is not None, "save did not raise"
        assert "optimizers 0 (AdamW) and 1 (SGD) both hold one parameter" in msg, msg
        assert "a checkpoint of its own" in msg
    assert not (tmp_path / "x").exists()


# --- conversion to a standard safetensors model, and back in with each rank reading its rows
def test_convert_gives_a_standard_model(source, tmp_path):
    path, saved = source[0], source[1]
    files = ckpt.convert(path, tmp_path / "single")  # no process group in this process
    assert [f.name for f in files] == ["model.safetensors"]
    plain = make("tied", seed=8)
    missing, unexpected = safetensors.torch.load_model(plain, files[0])
    assert not missing and not unexpected
    for k, v in plain.state_dict().items():
        assert torch.equal(v, saved[k]) and v.dtype == saved[k].dtype, k
    sharded_files = ckpt.convert(path, tmp_path / "sharded", max_shard_bytes=1500)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(sharded_files) > 3 and sharded_files[-1].name == "model.safetensors.index.json"
    assert set(index["weight_map"]) == set(saved) - {"head.weight"}
    for name, file in index["weight_map"].items():
        with safetensors.safe_open(tmp_path / "sharded" / file, "pt") as f:
            assert torch.equal(f.get_tensor(name), saved[name])
    from shardwise.checkpoint.cli import main

    main([str(path), str(tmp_path / "cli")])
    assert (tmp_path / "cli" / "model.safetensors").read_bytes() == files[0].read_bytes()


def from_standard(path):
    a = shardwise.shard(make("tied", 1), wrap=wrap_policy("by_size", "tied"), init_from=path)
    b = sharded("tied", "by_size", seed=2)
    full = None
    if dist.get_rank() == 0:
        full = dict(safetensors.torch.load_file(path / "model.safetensors"))
        full["head.weight"] = full["emb.weight"]
    shardwise.load_full_state_dict(b, full)
    sa, sb = shardwise.full_state_dict(a), shardwise.full_state_dict(b)
    return all(torch.equal(sa[k], sb[k]) for k in sb)


def from_standard_with_problems(path):
    model = sharded("mlp")
    try:
        ckpt.load_full(model, path)
    except CheckpointError as e:
        return str(e)


def test_load_full_equals_load_full_state_dict(source, pools, tmp_path):
    ckpt.convert(source[0], tmp_path / "single")
    ckpt.convert(source[0], tmp_path / "sharded", max_shard_bytes=1500)
    # the single file beside the sharded one, for load_full_state_dict
    shutil.copy(tmp_path / "single" / "model.safetensors", tmp_path / "sharded")
    assert pools(3).run(from_standard, tmp_path / "single") == [True] * 3
    assert pools(3).run(from_standard, tmp_path / "sharded") == [True] * 3
    msg = pools(2).run(from_standard_with_problems, tmp_path / "single")[0]
    assert (
        "tensors missing from" in msg
        and "'layers.0.lin.weight'" in msg
        and "has tensors the model does not" in msg
    )


# --- background saves: a snapshot, written while training goes on
def background(root):
    model = sharded("tied")
    opt = adamw(model)
    train("tied", model, opt, 0, 2)
    at_2 = shardwise.full_state_dict(model)
    original = saving._write_rank_file

    def slow(*args):  # a slow disk
        time.sleep(0.5)
        return original(*args)

    saving._write_rank_file = slow
    try:
        first = ckpt.save(root / "a", model, opt, step=2, async_=True)
        writing = not first.done()  # save() returned while its write (>= 0.5 s) goes on
        train("tied", model, opt, 2, 4)  # changes the shards while the first save writes
        at_4 = shardwise.full_state_dict(model)
        second = ckpt.save(root / "b", model, opt, step=4, async_=True)
        first_done = first.done()
        second.wait()
    finally:
        saving._write_rank_file = original
    results = []
    for name in ("a", "b"):
        fresh = sharded("tied", seed=6)
        ckpt.load(root / name, fresh, adamw(fresh))
        results.append(shardwise.full_state_dict(fresh))
    if dist.get_rank():
        return None
    same = [all(torch.equal(r[k], ref[k]) for k in ref) for r, ref in zip(results, (at_2, at_4))]
    return writing, first_done, same


def test_async_save_snapshots_and_writes_in_the_background(pools, tmp_path):
    writing, first_done, same = pools(2).run(background, tmp_path)[0]
    assert writing  # the write did not block the caller
    assert first_done  # a second save waits for the first
    assert same == [True, True]  # each checkpoint holds the state at its save() call
    assert ckpt.latest(tmp_path) == tmp_path / "b"


# --- memory: a load allocates O(shard) host memory per rank, not O(model)
def _rss(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def big_model():
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(10)])  # 42 MB of fp32
    return shardwise.shard(model, wrap=shardwise.wrap.by_class(nn.Linear))


def big_save(path):
    model = big_model()
    opt = adamw(model)
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    ckpt.save(path, model, opt)


def big_load(path):
    model = big_model()
    opt = adamw(model)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset this process's peak RSS (VmHWM) to its current RSS
    before = _rss("VmRSS")
    ckpt.load(path, model, opt)
    peak = _rss("VmHWM") - before
    shard = sum(p.numel() * 4 for p in model.parameters())
    return peak, shard


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_load_allocates_per_shard_memory(pools, tmp_path):
    pools(4).run(big_save, tmp_path / "big")
    total = sum(
        f.stat().st_size for f in (tmp_path / "big").glob("*.safetensors")
    )  # model + Adam state
    for peak, shard in pools(4).run(big_load, tmp_path / "big"):
        print(
            f"load peak RSS {peak / 2**20:.1f} MiB; shard params {shard / 2**20:.1f} MiB; "
            f"checkpoint {total / 2**20:.1f} MiB"
        )
        # the rank's new Adam state (2 shards) plus its rows mapped from its file (3 shards)
        assert peak <= 5 * shard + 8 * 2**20 < total
