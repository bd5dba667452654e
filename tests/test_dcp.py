"""torch.distributed.checkpoint (DCP) in and out, with FSDP2 (fully_shard on Gloo) really
running on the other side: FSDP2's and torchtitan's layouts load into shardwise at another
world size and train as FSDP2 resuming the same checkpoint does; shardwise's DCP saves load
into FSDP2 and train as shardwise continuing does; a crafted ``.metadata`` runs nothing."""

import os
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from nets import batch

import shardwise
from shardwise.checkpoint import CheckpointError
from shardwise.checkpoint import cli as convert_cli
from shardwise.checkpoint.unpickling import UnsafeCheckpointError, read_metadata

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks
STEPS = 20  # trained after the load, on both sides
TOL = {
    None: 1e-6,
    "bf16": 1e-2,
}  # fp32: reduction-order noise; bf16: its rounding, grown by 20 AdamW steps


def net(seed=0):
    """Rows 17, 11 and 3: uneven shards at 2, 3 and 4 ranks, an empty one at 4."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(13, 17), nn.Tanh(), nn.Linear(17, 11), nn.Tanh(), nn.Linear(11, 3)
    )


class Renamed(nn.Module):
    """The same network with its modules renamed: ``net``'s ``2.weight`` is ``body.2.weight``."""

    def __init__(self, seed=0):
        super().__init__()
        self.body = net(seed)

    def forward(self, x):
        return self.body(x)


def optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def train(model, opt, start, stop):
    """Steps on fixed global batches, each rank its slice; returns the global mean losses."""
    r, n = dist.get_rank(), dist.get_world_size()
    per = GLOBAL_BATCH // n
    losses = []
    for step in range(start, stop):
        x, y = batch("mlp", step, GLOBAL_BATCH)
        loss = nn.functional.cross_entropy(
            model(x[r * per : (r + 1) * per]), y[r * per : (r + 1) * per]
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / n)
    return losses


# --- FSDP2's side: fully_shard on every Linear and the root, its state_dict API, dcp
def fsdp2(seed, mixed):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # shardwise hands back fp32 outputs under "bf16"; FSDP2 does with output_dtype
    policy = (
        MixedPrecisionPolicy(torch.bfloat16, torch.float32, output_dtype=torch.float32)
        if mixed
        else MixedPrecisionPolicy()
    )
    model = net(seed)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def fsdp2_state(model, opt, layout):
    """The state dict an FSDP2 user saves and loads: PyTorch's recipe (``{"model", "optim"}``),
    what shardwise writes (``{"model", "optimizer"}``), or torchtitan's (model names at the
    top, flattened ``optimizer``, ``train_state``); and the options it was taken with."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    flat = StateDictOptions(flatten_optimizer_state_dict=layout == "torchtitan")
    msd, osd = get_state_dict(model, opt, options=flat)
    if layout == "torchtitan":
        return {**msd, "optimizer": osd, "train_state": {"step": torch.tensor(0)}}, flat
    return {"model": msd, "optim" if layout == "recipe" else "optimizer": osd}, flat


def fsdp2_set_state(model, opt, sd, layout, flat):
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if layout == "torchtitan":
        msd = {k: v for k, v in sd.items() if k not in ("optimizer", "train_state")}
        osd = sd["optimizer"]
    else:
        msd, osd = sd["model"], sd["optim" if layout == "recipe" else "optimizer"]
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=flat)


def fsdp2_full(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in full.items()}


def fsdp2_train_and_save(path, opt_kind, layout, mixed, steps):
    import torch.distributed.checkpoint as dcp

    model = fsdp2(0, mixed)
    opt = optimizer(opt_kind, model.parameters())
    train(model, opt, 0, steps)
    sd, _ = fsdp2_state(model, opt, layout)
    if layout == "torchtitan":
        sd["train_state"]["step"] = torch.tensor(steps)
        path = os.path.join(path, f"step-{steps}")
    dcp.save(sd, checkpoint_id=path)
    return path


def fsdp2_resume(path, opt_kind, layout, mixed, start):
    import torch.distributed.checkpoint as dcp

    model = fsdp2(7, mixed)  # other initial values, which the load must overwrite
    opt = optimizer(opt_kind, model.parameters())
    sd, flat = fsdp2_state(model, opt, layout)
    dcp.load(sd, checkpoint_id=path)
    fsdp2_set_state(model, opt, sd, layout, flat)
    losses = train(model, opt, start, start + STEPS)
    return losses, fsdp2_full(model)


# --- shardwise's side
def sharded(seed, options, renamed=False):
    options = dict(options)
    if options.pop("owned", False):
        options["placement"] = shardwise.placement.matrices
    model = Renamed(seed) if renamed else net(seed)
    return shardwise.shard(model, wrap=shardwise.wrap.by_class(nn.Linear), **options)


def initial():
    return net(0).state_dict()


def bare(full, renamed):
    return {k.removeprefix("body.") if renamed else k: v for k, v in full.items()}


def shardwise_resume(path, opt_kind, options, renamed, start):
    model = sharded(7, options, renamed)
    opt = optimizer(opt_kind, model.parameters())
    opt.param_groups[0]["lr"] = 0.5  # wrong on purpose: the load restores the checkpoint's
    info = shardwise.load(path, model, opt, names=(lambda n: "body." + n) if renamed else None)
    losses = train(model, opt, start, start + STEPS)
    return info, losses, bare(shardwise.full_state_dict(model, rank0_only=False), renamed)


def shardwise_train_save_continue(path, opt_kind, options, steps, format="dcp"):
    model = sharded(0, options)
    opt = optimizer(opt_kind, model.parameters())
    train(model, opt, 0, steps)
    shardwise.save(path, model, opt, step=steps, extra={"next": steps}, format=format)
    losses = train(model, opt, steps, steps + STEPS)
    return losses, shardwise.full_state_dict(model, rank0_only=False)


def assert_close(a_losses, a, b_losses, b, tol):
    """Within ``tol``; returns the largest difference (parameters and losses)."""
    assert a.keys() == b.keys()
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    diff = max(diff, *(abs(x - y) for x, y in zip(a_losses, b_losses, strict=True)))
    assert diff <= tol, diff
    return diff


FROM_FSDP2 = [  # (optimizer, layout, shardwise's options, world sizes: FSDP2 saves, both resume)
    ("adamw", "recipe", {}, (2, 3)),
    ("sgd", "recipe", {}, (2, 3)),
    ("adamw", "torchtitan", {}, (2, 3)),
    ("adamw", "recipe", {"mixed_precision": "bf16"}, (2, 3)),
    ("adamw", "torchtitan", {"owned": True}, (2, 3)),
    ("sgd", "recipe", {"strategy": "hybrid_shard", "shard_size": 2}, (2, 4)),
]


@pytest.mark.parametrize(
    "opt_kind,layout,options,sizes", FROM_FSDP2, ids=lambda v: str(v).replace(" ", "")
)
def test_fsdp2_checkpoint_resumes_in_shardwise_as_in_fsdp2(
    pools, tmp_path, opt_kind, layout, options, sizes
):
    saver, resumer = sizes
    mixed = options.get("mixed_precision")
    renamed = layout == "torchtitan"  # and its modules renamed: names= maps them
    path = pools(saver).run(fsdp2_train_and_save, str(tmp_path), opt_kind, layout, mixed, 5)[0]
    info, ours, our_full = pools(resumer).run(
        shardwise_resume, path, opt_kind, options, renamed, 5
    )[0]
    theirs, their_full = pools(resumer).run(fsdp2_resume, path, opt_kind, layout, mixed, 5)[0]
    start = pools(1).run(initial)[0]
    moved = min((their_full[k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-2  # both really trained (25 steps) from the same start
    assert info.step == (5 if layout == "torchtitan" else None) and not info.rng_restored
    diff = assert_close(ours, our_full, theirs, their_full, TOL[mixed])
    print(
        f"FSDP2 N={saver} -> N={resumer}, {opt_kind}, {layout}, {options}: max difference {diff:.3g}"
    )


TO_FSDP2 = [  # (optimizer, shardwise's options, world size of the save; FSDP2 resumes at 1)
    ("adamw", {}, 2),
    ("sgd", {}, 2),
    ("adamw", {"mixed_precision": "bf16"}, 2),
    ("adamw", {"owned": True}, 2),
    ("adamw", {"strategy": "hybrid_shard", "shard_size": 2}, 4),
]


@pytest.mark.parametrize("opt_kind,options,saver", TO_FSDP2, ids=lambda v: str(v).replace(" ", ""))
def test_shardwise_dcp_save_resumes_in_fsdp2(pools, tmp_path, opt_kind, options, saver):
    path = str(tmp_path / "ckpt")
    mixed = options.get("mixed_precision")
    ours, our_full = pools(saver).run(shardwise_train_save_continue, path, opt_kind, options, 5)[0]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # published by rename, no temporary left
    theirs, their_full = pools(1).run(fsdp2_resume, path, opt_kind, "shardwise", mixed, 5)[0]
    diff = assert_close(ours, our_full, theirs, their_full, TOL[mixed])
    print(f"shardwise N={saver} {opt_kind} {options} -> FSDP2 N=1: max difference {diff:.3g}")


def test_convert_to_dcp_resumes_in_fsdp2(pools, tmp_path):
    """A checkpoint in shardwise's own format, converted offline by ``shardwise convert --to
    dcp``, resumes in FSDP2 as the shardwise run that saved it continues; converted back
    (``--to shardwise``), it resumes as the original does."""
    native, converted = tmp_path / "native", tmp_path / "dcp"
    ours, our_full = pools(2).run(
        shardwise_train_save_continue, str(native), "adamw", {}, 5, "shardwise"
    )[0]
    convert_cli.main([str(native), str(converted), "--to", "dcp"])
    assert sorted(os.listdir(tmp_path)) == ["dcp", "native"]
    theirs, their_full = pools(1).run(fsdp2_resume, str(converted), "adamw", "shardwise", None, 5)[
        0
    ]
    diff = assert_close(ours, our_full, theirs, their_full, TOL[None])
    print(f"shardwise N=2, converted to DCP -> FSDP2 N=1: max difference {diff:.3g}")
    info = pools(1).run(load_info, str(converted))[0]
    assert (info.step, info.extra, info.world_size) == (5, {"next": 5}, 2)
    # and back (--to shardwise): step, extra and world size kept; no RNG states to restore
    back = tmp_path / "back"
    to_shardwise = [str(converted), str(back), "--to", "shardwise", "--model", "test_dcp:net"]
    with pytest.raises(SystemExit, match="saved by shardwise from a AdamW: drop --optimizer SGD"):
        convert_cli.main([*to_shardwise, "--optimizer", "SGD"])
    convert_cli.main(to_shardwise)  # the class recorded by shardwise: no --optimizer needed
    (info, ours, our_full), (_, theirs, their_full) = pools(2).run(
        resume_converted_and_dcp, str(back), str(native), "adamw"
    )[0]
    assert (info.step, info.extra, info.world_size, info.rng_restored) == (5, {"next": 5}, 2, False)
    assert_close(ours, our_full, theirs, their_full, 0.0)


def load_info(path):
    model = sharded(0, {})
    return shardwise.load(path, model, optimizer("adamw", model.parameters()))


# --- safe to open: nothing a crafted checkpoint names runs
class Payload:
    """Unpickled by plain pickle, this creates ``marker``: the code a crafted file could run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_metadata_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".metadata").write_bytes(
        pickle.dumps({"state_dict_metadata": Payload(marker)})
    )
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system.*refusing to open it"):
        read_metadata(tmp_path / "ckpt")
    assert not marker.exists()
    with open(
        tmp_path / "ckpt" / ".metadata", "rb"
    ) as f:  # the payload is live: plain pickle runs it
        pickle.load(f)
    assert marker.exists()


def test_metadata_pointing_outside_the_directory_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    from shardwise.checkpoint.dcp import Reading

    with warnings.catch_warnings():  # one process, on purpose
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert Reading(tmp_path / "ckpt").metadata.state_dict_metadata["w"].size == (2,)
    metadata = read_metadata(tmp_path / "ckpt")
    for info in metadata.storage_data.values():
        info.relative_path = "../outside.distcp"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"'\.\./outside\.distcp', outside the checkpoint's"):
        Reading(tmp_path / "ckpt")


def load_crafted(path, marker, where):
    """Write a DCP checkpoint whose metadata (``where="metadata"``) or one of whose values
    (``"value"``) runs a command when plain-unpickled; load it into shardwise."""
    import torch.distributed.checkpoint as dcp

    plain = net(0)
    state = {"2.weight": {"momentum_buffer": Payload(marker) if where == "value" else None}}
    groups = [{"lr": 0.05, "momentum": 0.9, "params": ["2.weight"]}]
    dcp.save(
        {"model": plain.state_dict(), "optimizer": {"state": state, "param_groups": groups}},
        checkpoint_id=path,
    )
    dist.barrier()
    if where == "metadata" and dist.get_rank() == 0:
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump({"state_dict_metadata": Payload(marker)}, f)
    dist.barrier()
    model = sharded(3, {})
    opt = optimizer("sgd", model.parameters())
    before = shardwise.full_state_dict(model, rank0_only=False)
    try:
        shardwise.load(path, model, opt)
    except CheckpointError as e:
        after = shardwise.full_state_dict(model, rank0_only=False)
        return str(e), all(torch.equal(before[k], after[k]) for k in before)
    return None, None


@pytest.mark.parametrize("where", ["metadata", "value"])
def test_crafted_dcp_checkpoint_ends_in_a_named_error(pools, tmp_path, where):
    marker = tmp_path / "ran"
    out = pools(2).run(load_crafted, str(tmp_path / "ckpt"), str(marker), where)
    assert not marker.exists()
    for message, unchanged in out:  # every rank raises, nothing changed
        assert message is not None and unchanged
        assert (
            "posix.system" in message
            if where == "metadata"
            else "'optimizer.state.2.weight.momentum_buffer' holds more than plain data" in message
        )


# --- mismatches: named errors on every rank, before anything changed
def swapped(name):
    """Checkpoint name -> model name, with layers 2 and 4 swapped."""
    return {"2": "4", "4": "2"}.get(name[0], name[0]) + name[1:]


def load_mismatched(path):
    import torch.distributed.checkpoint as dcp

    model = fsdp2(0, None)
    opt = optimizer("sgd", model.parameters())
    train(model, opt, 0, 2)
    sd, _ = fsdp2_state(model, opt, "recipe")
    dcp.save(sd, checkpoint_id=path)
    messages = []
    cases = [
        (lambda: sharded(1, {}), "adamw", None),  # the optimizer's class
        (lambda: sharded(1, {}, renamed=True), "sgd", None),  # renamed, without names=
        (lambda: sharded(1, {}), "sgd", swapped),  # shapes then differ
        (lambda: sharded(1, {}), "sgd", None),  # and one that loads
    ]
    ours = sharded(1, {})
    opt = optimizer("sgd", ours.parameters())
    not_a_checkpoint = os.path.join(os.path.dirname(path), "notes")
    os.makedirs(not_a_checkpoint, exist_ok=True)
    for kwargs in (
        {"format": "xyz"},
        {"format": "dcp", "async_": True},
        {"format": "dcp", "path": not_a_checkpoint},
    ):
        kwargs = {"path": path + "-out", **kwargs}
        try:
            shardwise.save(kwargs.pop("path"), ours, opt, **kwargs)
            messages.append(None)
        except CheckpointError as e:
            messages.append(str(e))
    for build, opt_kind, names in cases:
        ours = build()
        before = shardwise.full_state_dict(ours, rank0_only=False)
        try:
            shardwise.load(path, ours, optimizer(opt_kind, ours.parameters()), names=names)
            messages.append(None)
        except CheckpointError as e:
            after = shardwise.full_state_dict(ours, rank0_only=False)
            assert all(torch.equal(before[k], after[k]) for k in before)
            messages.append(str(e))
    return messages


def test_mismatched_dcp_checkpoints_raise_named_errors(pools, tmp_path):
    for messages in pools(2).run(load_mismatched, str(tmp_path / "ckpt")):
        bad_format, asynchronous, occupied, wrong_class, renamed, shapes, fine = messages
        assert "format must be 'shardwise' or 'dcp', not 'xyz'" in bad_format
        assert "saves synchronously" in asynchronous
        assert "exists and is not a checkpoint" in occupied
        assert "not a AdamW" in wrong_class and "'momentum'" in wrong_class
        assert "missing from the checkpoint" in renamed and "names=" in renamed
        assert "'body.0.weight'" in renamed
        assert (
            "'model.4.weight' has shape [3, 11] in the checkpoint; '2.weight' needs [11, 17]"
            in shapes
        )
        assert fine is None


# --- a tied parameter (two names, one weight), and a model-only load
def tied_save(path):
    from nets import make, wrap_policy

    model = shardwise.shard(make("tied", 0), wrap=wrap_policy("by_class", "tied"))
    opt = optimizer("adamw", model.parameters())
    x, y = batch("tied", 0, 4)
    r = dist.get_rank()
    nn.functional.cross_entropy(
        model(x[2 * r : 2 * r + 2]).flatten(0, 1), y[2 * r : 2 * r + 2].flatten()
    ).backward()
    opt.step()
    shardwise.save(path, model, opt, format="dcp")
    return shardwise.full_state_dict(model, rank0_only=False)


def tied_load(path, side):
    from nets import make, wrap_policy

    if side == "fsdp2":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(make("tied", 5))
        opt = optimizer("adamw", model.parameters())
        sd, flat = fsdp2_state(model, opt, "shardwise")
        dcp.load(sd, checkpoint_id=path)
        fsdp2_set_state(model, opt, sd, "shardwise", flat)
        return fsdp2_full(model), sorted(opt.state[model.emb.weight])
    model = shardwise.shard(make("tied", 5), wrap=wrap_policy("by_size", "tied"))
    shardwise.load(path, model)  # the model alone
    return shardwise.full_state_dict(model, rank0_only=False), None


def test_tied_parameter_round_trips_through_dcp(pools, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = pools(2).run(tied_save, path)[0]
    ours, _ = pools(3).run(tied_load, path, "shardwise")[0]
    theirs, state_keys = pools(1).run(tied_load, path, "fsdp2")[0]
    assert state_keys == ["exp_avg", "exp_avg_sq", "step"]
    native = str(tmp_path / "native")  # and converted to shardwise's format: one weight, two names
    convert_cli.main([path, native, "--to", "shardwise", "--model", "test_dcp:tied_model"])
    converted, _ = pools(3).run(tied_load, native, "shardwise")[0]
    for got in (ours, theirs, converted):
        assert all(torch.equal(saved[k], got[k]) for k in saved)
    assert torch.equal(theirs["head.weight"], saved["emb.weight"])


def tied_model():
    from nets import make

    return make("tied", 0)


# --- DCP -> shardwise's format, offline: `shardwise convert CKPT OUT --to shardwise`
def resume_converted_and_dcp(converted, path, opt_kind):
    """Load the converted checkpoint and the one it came from into two models, and train both
    the same 20 steps."""
    out = []
    for where in (converted, path):
        info, losses, full = shardwise_resume(where, opt_kind, {}, False, 5)
        out.append((info, losses, full))
    return out


FROM_DCP = [  # (optimizer, FSDP2's layout, what convert is told besides --model)
    ("adamw", "recipe", ["--optimizer", "AdamW"]),  # Adam's and AdamW's groups look alike
    ("sgd", "recipe", []),  # SGD is known by its hyper-parameters
    ("adamw", "torchtitan", ["--optimizer", "AdamW"]),
]


@pytest.mark.parametrize("opt_kind,layout,flags", FROM_DCP, ids=lambda v: str(v).replace(" ", ""))
def test_convert_fsdp2_checkpoint_to_shardwise_resumes_as_the_dcp(
    pools, tmp_path, opt_kind, layout, flags
):
    """FSDP2 saves DCP at N=2; converted offline to shardwise's format, it loads at N=3 and
    trains as loading the DCP directory itself does."""
    path = pools(2).run(fsdp2_train_and_save, str(tmp_path / "dcp"), opt_kind, layout, None, 5)[0]
    converted = tmp_path / "native"
    convert_cli.main([path, str(converted), "--to", "shardwise", "--model", "test_dcp:net", *flags])
    assert sorted(os.listdir(converted)) == [
        "COMMITTED",
        "index.json",
        "rank-00000-of-00001.safetensors",
    ]
    (info, ours, our_full), (dinfo, theirs, their_full) = pools(3).run(
        resume_converted_and_dcp, str(converted), path, opt_kind
    )[0]
    start = pools(1).run(initial)[0]
    assert min((our_full[k] - start[k]).abs().max().item() for k in start) > 1e-2  # trained
    step = 5 if layout == "torchtitan" else None
    assert (info.step, info.world_size, info.strategy, info.rng_restored) == (
        step,
        None,
        None,
        False,
    )
    assert dinfo.step == step
    diff = assert_close(ours, our_full, theirs, their_full, TOL[None])
    print(f"FSDP2 N=2 {opt_kind} {layout} -> converted -> shardwise N=3: max difference {diff:.3g}")


class WithBuffer(nn.Module):
    """``net`` and a persistent buffer the checkpoint lacks."""

    def __init__(self):
        super().__init__()
        self.body = net()
        self.register_buffer("scale", torch.ones(3))


def bigger():
    return nn.Sequential(
        nn.Linear(13, 18), nn.Tanh(), nn.Linear(18, 11), nn.Tanh(), nn.Linear(11, 3)
    )


def test_convert_to_shardwise_refuses_what_it_cannot_tell(pools, tmp_path, capsys):
    """Each ambiguity or mismatch is a named error saying the fix, and nothing is written."""
    path = pools(1).run(fsdp2_train_and_save, str(tmp_path / "dcp"), "adamw", "recipe", None, 1)[0]
    out = tmp_path / "out"

    def refused(*flags):
        with pytest.raises(SystemExit) as e:  # the message, no traceback
            convert_cli.main([path, str(out), "--to", "shardwise", *flags])
        assert not out.exists()
        return str(e.value)

    refused()  # argparse's error, on stderr
    assert "needs the checkpoint's model" in capsys.readouterr().err
    m = refused("--model", "test_dcp:nowhere")
    assert "--model 'test_dcp:nowhere'" in m
    m = refused("--model", "test_dcp:net")
    assert "fit several optimizers (Adam, AdamW)" in m and "--optimizer AdamW" in m
    m = refused("--model", "test_dcp:net", "--optimizer", "SGD")
    assert "not a SGD" in m and "'betas'" in m
    m = refused("--model", "test_dcp:net", "--optimizer", "Adamw")
    assert "not an optimizer of torch.optim" in m and "AdamW" in m
    m = refused("--model", "test_dcp:bigger", "--optimizer", "AdamW")
    assert "'model.0.weight' has shape [17, 13]" in m and "'0.weight' has [18, 13]" in m
    m = refused("--model", "test_dcp:WithBuffer", "--optimizer", "AdamW")
    assert "missing from the checkpoint" in m and "'scale'" in m
    refused("--model", "test_dcp:net", "--to", "dcp")
    assert "go with --to shardwise" in capsys.readouterr().err
    out.mkdir()
    with pytest.raises(SystemExit, match="exists: convert writes a new directory"):
        convert_cli.main([path, str(out), "--to", "shardwise", "--model", "test_dcp:net"])
    assert os.listdir(out) == []


def test_convert_to_shardwise_with_a_hugging_face_config(tmp_path, monkeypatch):
    """``--hf CONFIG_DIR`` names the model as ``shardwise plan`` does: a model-only DCP save of
    a transformers model converts with its tied head recorded as one parameter, bit for bit."""
    transformers = pytest.importorskip("transformers", reason="needs the [hf] extra")
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from shardwise.checkpoint.index import read_index

    config = transformers.GPT2Config(
        n_layer=1, n_embd=8, n_head=2, vocab_size=31, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    config.save_pretrained(tmp_path / "config")
    model = transformers.GPT2LMHeadModel(config)
    with warnings.catch_warnings():  # one process, on purpose: DCP warns it assumes so
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    monkeypatch.chdir(tmp_path)
    convert_cli.main(["dcp", "native", "--to", "shardwise", "--hf", "config"])
    index = read_index(tmp_path / "native")
    stored = load_file(tmp_path / "native" / "rank-00000-of-00001.safetensors")
    assert index.optimizer is None and index.step is None
    assert index.tensors["transformer.wte.weight"].aliases == ("lm_head.weight",)
    expected = dict(model.named_parameters())  # first names only: the head is the embedding
    assert {n for n, t in index.tensors.items() if t.kind == "param"} == set(expected)
    assert all(torch.equal(stored[n], p.detach()) for n, p in expected.items())
