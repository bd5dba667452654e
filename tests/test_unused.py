"""Data-dependent models train exactly like one process: a parameter that gets no gradient on
any rank keeps its ``.grad`` (None) and the optimizer skips it; one used on some ranks gets
the average over all ranks (zeros from the others), as with DDP's find_unused_parameters."""

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from nets import batch, differences, global_mean, local_slice, loss_of, make, wrap_policy

import shardwise

STRATEGIES = ["full_shard", "shard_grad_op", "no_shard"]


def train_dynamic(
    kind: str,
    strategy: str,
    *,
    wrap: str = "by_class",
    mixed_precision=None,
    cpu_offload: bool = False,
    micro: int = 1,
    clip: float | None = None,
    keep_grads: bool = False,
    steps: int = 4,
    per_rank: int = 2,
):
    """Train a sharded copy and the unsharded reference on the same global batches (AdamW,
    whose weight decay and momentum move any parameter that gets a gradient, even zero).

    Returns on rank 0, per step, the global losses of both and the names of the parameters
    whose ``.grad`` is None after backward on each side; then the largest difference of the
    final parameters and how far the reference moved, per parameter name.
    """
    ref = make(kind)
    start = copy.deepcopy(ref.state_dict())
    model = shardwise.shard(
        copy.deepcopy(ref), wrap=wrap_policy(wrap, kind), strategy=strategy,
        mixed_precision=mixed_precision, cpu_offload=cpu_offload,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    n = dist.get_world_size()
    losses, ref_losses, nones, norms = [], [], [], []
    for step in range(steps):
        if kind == "double":  # the root's branch runs every other step
            model.use_branch = ref.use_branch = step % 2 == 0
        x, y = batch(kind, step, per_rank * n * micro)
        total = ref_total = 0.0
        for i, (xi, yi) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            sync = contextlib.nullcontext() if i == micro - 1 else shardwise.no_sync(model)
            with sync:
                loss = loss_of(model, local_slice(xi), local_slice(yi)) / micro
                loss.backward()
            total += global_mean(loss)
            ref_loss = loss_of(ref, xi, yi) / micro
            ref_loss.backward()
            ref_total += ref_loss.item()
        nones.append((
            sorted(k for k, p in model.named_parameters() if p.grad is None),
            sorted(k for k, p in ref.named_parameters() if p.grad is None),
        ))
        if clip is not None:
            norms.append((
                shardwise.clip_grad_norm_(model, clip).item(),
                torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], clip).item(),
            ))
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=not keep_grads)
        ref_opt.zero_grad(set_to_none=not keep_grads)
        losses.append(total)
        ref_losses.append(ref_total)
    compared = differences(model, ref, start)
    if compared is None:
        return None
    diff, moved = compared
    return losses, ref_losses, nones, norms, diff, moved


def check(result, *, rel=1e-5, atol=1e-5):
    losses, ref_losses, nones, norms, diff, moved = result
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert a == pytest.approx(b, rel=rel), f"step {step}: sharded {a} vs reference {b}"
    for step, (mine, ref) in enumerate(nones):
        assert mine == ref, f"step {step}: .grad None on {mine}, in one process on {ref}"
    for a, b in norms:
        assert a == pytest.approx(b, rel=rel)
    assert diff <= atol
    return moved


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world_size", [2, 3])
def test_moe_trains_like_one_process(pools, world_size, strategy):
    moved = check(pools(world_size).run(train_dynamic, "moe", strategy)[0])
    idle = [k for k in moved if ".experts.3." in k]
    assert idle and all(moved[k] == 0 for k in idle)  # no rank routes to it: never stepped
    assert min(moved[k] for k in moved if ".experts.0." in k) > 1e-3  # the others trained


@pytest.mark.parametrize("wrap", ["by_class", "by_size"])  # lin2 inside a unit / its own unit
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_double_linear_and_a_branch_every_other_step(pools, strategy, wrap):
    moved = check(pools(2).run(train_dynamic, "double", strategy, wrap=wrap, steps=5)[0])
    assert all(moved[f"blocks.{i}.lin2.weight"] == 0 for i in range(3))
    assert moved["branch.weight"] > 1e-3


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_unused_under_no_sync_clipping_and_kept_gradients(pools, strategy):
    result = pools(2).run(
        train_dynamic, "moe", strategy, micro=2, clip=0.05, keep_grads=True, steps=3
    )[0]
    moved = check(result)
    assert all(a > 0.05 for a, _ in result[3])  # clipping really clipped
    assert all(moved[k] == 0 for k in moved if ".experts.3." in k)


@pytest.mark.parametrize(
    "strategy, options",
    [
        ("full_shard", {"cpu_offload": True}),
        ("full_shard", {"mixed_precision": "bf16"}),
        ("no_shard", {"mixed_precision": "bf16"}),
    ],
)
def test_unused_with_offload_and_mixed_precision(pools, strategy, options):
    bf16 = "mixed_precision" in options
    result = pools(2).run(train_dynamic, "double", strategy, steps=3, **options)[0]
    moved = check(result, rel=2e-2 if bf16 else 1e-5, atol=2e-2 if bf16 else 1e-5)
    assert all(moved[f"blocks.{i}.lin2.bias"] == 0 for i in range(3))


# --- experts wrapped as units of their own: each rank calls the one its data picks
class Switch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(13, 8)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        return self.out(self.experts[0 if float(x[:, 0].mean()) > 0 else 1](h))


def switch_batch(step):
    """Rank 0's rows pick expert 0 at every step, rank 1's expert 1."""
    x, y = batch("mlp", step, 4)
    x[:2, 0], x[2:, 0] = 5.0, -5.0
    return x, y


def train_switch(strategy, steps=3):
    torch.manual_seed(0)
    ref = Switch()
    model = shardwise.shard(copy.deepcopy(ref), wrap=shardwise.wrap.by_class(torch.nn.Linear), strategy=strategy)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = switch_batch(step)
        loss_of(model, local_slice(x), local_slice(y)).backward()
        opt.step()
        opt.zero_grad()
        # the reference sees each rank's half on its own path, in one loss
        h = ref.inp(x)
        out = torch.cat([ref.out(ref.experts[0](h[:2])), ref.out(ref.experts[1](h[2:]))])
        (0.5 * torch.nn.functional.cross_entropy(out[:2], y[:2])
         + 0.5 * torch.nn.functional.cross_entropy(out[2:], y[2:])).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = shardwise.full_state_dict(model)
    return max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items()) if full else None


def test_expert_units_on_different_ranks_train_like_ddp_without_sharding(pools):
    # no_shard reduces every unit in one fixed order, so a unit may run on some ranks only
    assert pools(2).run(train_switch, "no_shard")[0] <= 1e-6
