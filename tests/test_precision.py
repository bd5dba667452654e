"""Mixed precision: 16-bit gathers and compute, fp32 master shards, selectable reduction dtype,
fp16 loss scaling agreed by every rank."""

import copy

import pytest
import torch
import torch.distributed as dist
from nets import batch, local_slice, loss_of, make, wrap_policy

import shardwise
from shardwise import MixedPrecision, ShardwiseError
from shardwise.core.unit import ShardedUnit


def gpt_losses(mixed_precision, steps=20):
    from shardwise.job.data import get_batch, rank_slice
    from shardwise.job.models import GPT, Block, gpt_config

    torch.manual_seed(0)
    model = shardwise.shard(GPT(gpt_config("tiny")), wrap=shardwise.wrap.by_class(Block), mixed_precision=mixed_precision)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    r, n = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        x, y = get_batch(step, 4 * n, 32)
        loss = model(rank_slice(x, r, n), rank_slice(y, r, n))
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().float()
        dist.all_reduce(t)
        losses.append(t.item() / n)
    dtypes = {p.dtype for p in model.parameters()} | {
        t.dtype for st in opt.state.values() for t in st.values() if t.numel() > 1
    }
    return losses, dtypes


def test_bf16_tracks_fp32_on_the_builtin_gpt(pools):
    fp32, _ = pools(2).run(gpt_losses, None)[0]
    bf16, dtypes = pools(2).run(gpt_losses, "bf16")[0]
    assert dtypes == {torch.float32}  # master shards and optimizer state stay fp32
    assert bf16[-1] < bf16[0] - 0.5  # it trains
    for a, b in zip(fp32, bf16):
        assert abs(a - b) <= 0.02 * a, (fp32, bf16)  # within 2% of the fp32 loss at every step


def bytes_and_grads(policy):
    ref = make("tied")
    model = shardwise.shard(copy.deepcopy(ref), wrap=wrap_policy("by_class", "tied"), mixed_precision=policy)
    x, y = batch("tied", 0, 2 * dist.get_world_size())
    shardwise.reset_comm_stats()
    loss_of(model, local_slice(x), local_slice(y)).backward()
    stats = shardwise.comm_stats()
    grad_dtypes = {p.grad.dtype for p in model.parameters()}
    rows = shardwise.dtype_table(model, show=False)
    return stats["all_gather"].bytes, stats["reduce_scatter"].bytes, grad_dtypes, rows


def test_gather_bytes_halve_and_reduce_dtype_is_selectable(pools):
    pool = pools(2)
    ag32, rs32, g32, _ = pool.run(bytes_and_grads, None)[0]
    ag16, rs_f32, g16, rows = pool.run(bytes_and_grads, "bf16")[0]
    _, rs16, g16b, rows16 = pool.run(
        bytes_and_grads, MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    )[0]
    assert ag16 * 2 == ag32  # the gather moves half the bytes
    assert rs_f32 == rs32  # "bf16" reduces in fp32
    assert rs16 * 2 == rs32  # a bf16 reduction sends half
    assert g32 == g16 == g16b == {torch.float32}  # gradients land on fp32 shards either way
    assert rows[0] == {
        "unit": "blocks.0", "storage": "float32", "compute": "bfloat16",
        "communication": "bfloat16", "reduction": "float32", "optimizer_state": "float32",
    }
    assert rows16[-1]["reduction"] == "bfloat16"


def fp16_with_injected_inf(poison_rank):
    model = shardwise.shard(make("tied"), wrap=wrap_policy("by_class", "tied"), mixed_precision="fp16")
    scaler = shardwise.GradScaler(model, init_scale=1024.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch("tied", 0, 2 * dist.get_world_size())
    scaler.scale(loss_of(model, local_slice(x), local_slice(y)).float()).backward()
    if dist.get_rank() == poison_rank:
        next(p for p in model.parameters() if p.grad is not None and p.grad.numel()).grad.view(-1)[0] = float("inf")
    stepped = scaler.step(opt)
    scaler.update()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # the next, clean step goes through everywhere
    opt.zero_grad()
    scaler.scale(loss_of(model, local_slice(x), local_slice(y)).float()).backward()
    stepped_after = scaler.step(opt)
    scaler.update()
    return stepped, unchanged, scaler.get_scale(), stepped_after


def test_fp16_inf_on_one_rank_skips_the_step_on_every_rank(pools):
    for stepped, unchanged, scale, stepped_after in pools(3).run(fp16_with_injected_inf, 1):
        assert not stepped and unchanged and scale == 512.0 and stepped_after


def fp16_without_scaler():
    model = shardwise.shard(make("tied"), wrap=wrap_policy("by_class", "tied"), mixed_precision="fp16")
    x, _ = batch("tied", 0, 2)
    try:
        model(x)
    except ShardwiseError as e:
        return str(e)


def test_fp16_without_a_scaler_is_refused(pools):
    msg = pools(1).run(fp16_without_scaler)[0]
    assert "shardwise.GradScaler(model)" in msg and "float16" in msg


def test_unknown_shorthand_is_refused():
    with pytest.raises(ShardwiseError, match="'int8'"):
        MixedPrecision.of("int8")


def outputs_and_buffers():
    model = make("tied")
    model.register_buffer("scale_buf", torch.ones(3))
    shardwise.shard(
        model, wrap=wrap_policy("by_class", "tied"),
        mixed_precision=MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16, torch.float32),
    )
    x, _ = batch("tied", 0, 2)
    return model(x).dtype, model.scale_buf.dtype, {u.compute_dtype for u in shardwise.units(model) if isinstance(u, ShardedUnit)}


def test_output_and_buffer_dtypes(pools):
    out, buf, compute = pools(1).run(outputs_and_buffers)[0]
    assert out == torch.float32 and buf == torch.bfloat16 and compute == {torch.bfloat16}


def one_rank_bf16(strategy):
    """Two steps of the mlp model at N=1 in bf16: the shard gradients, the same model cast to
    bf16 in one process without shardwise (its gradients brought to fp32), the counters."""
    ref = make("mlp").to(torch.bfloat16)
    model = shardwise.shard(make("mlp"), wrap=wrap_policy("by_class", "mlp"), strategy=strategy, mixed_precision="bf16")
    shardwise.reset_comm_stats()
    for step in range(2):
        x, y = batch("mlp", step, 8)
        model.zero_grad()
        loss_of(model, x, y).backward()
        ref.zero_grad()
        loss_of(ref, x.to(torch.bfloat16), y).backward()
    stats = shardwise.comm_stats()
    ours = {n: p.grad for n, p in model.named_parameters()}
    theirs = {n: None if p.grad is None else p.grad.float() for n, p in ref.named_parameters()}
    return ours, theirs, stats["all_gather"], stats["reduce_scatter"]


@pytest.mark.parametrize("strategy", ["full_shard", "no_shard"])
def test_one_rank_bf16_is_bitwise_a_cast_model(pools, strategy):
    """At N=1 a gather is a cast into the full buffer and a reduction a cast of each
    gradient, with no collective issued: the gradients are exactly a bf16 model's, and the
    counters count the gathers with nothing sent."""
    ours, theirs, gathers, scatters = pools(1).run(one_rank_bf16, strategy)[0]
    assert ours.keys() == theirs.keys()
    assert sum(g is not None for g in ours.values()) > 1
    for name, g in ours.items():
        if theirs[name] is None:  # (a parameter the model leaves unused)
            assert g is None, name
        else:
            # (a 0-dim parameter's shard has one row)
            assert g.dtype == torch.float32 and torch.equal(g, theirs[name].reshape(g.shape)), name
    assert gathers.bytes == 0 and scatters.calls == 0
    if strategy == "full_shard":
        assert gathers.calls > 0 and gathers.payload_bytes > 0
