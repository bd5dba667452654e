"""Owned placement: optimizers that need whole matrices (Muon, Adafactor) train exactly like one
process, with nothing communicated in their step; row placement under them raises."""

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from nets import (
    Block,
    MoEBlock,
    TiedTransformer,
    batch,
    differences,
    global_mean,
    local_slice,
    loss_of,
    make,
    train_pair,
)

import shardwise
from shardwise.bench.optimizers import fp32_newton_schulz, orthogonalized
from shardwise.core.placement import choose_owners


# --- models with matrices the nets do not have: a weight tied inside a unit, stacked experts
class TiedPair(nn.Module):
    """Two linear layers of one block share their weight (a tie inside a wrapped unit)."""

    def __init__(self, d: int = 12):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.b.weight = self.a.weight

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class StackedExperts(nn.Module):
    """Fused expert weights ``[E, d, h]`` as Hugging Face's MoE layers keep them; each row goes
    to expert ``argmax(gate)``."""

    def __init__(self, d: int = 8, experts: int = 4):
        super().__init__()
        self.gate = nn.Linear(d, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, d, 2 * d) * 0.2)
        self.down = nn.Parameter(torch.randn(experts, 2 * d, d) * 0.2)

    def forward(self, x):
        e = self.gate(x).argmax(-1)
        h = F.gelu(torch.einsum("bd,bdh->bh", x, self.up[e]))
        return x + torch.einsum("bh,bhd->bd", h, self.down[e])


class Bare(nn.Linear):
    """A block that is one matrix: owned, the other ranks hold nothing of its unit."""

    def __init__(self, d: int):
        super().__init__(d, d, bias=False)

    def forward(self, x):
        return torch.tanh(super().forward(x))


class Stack(nn.Module):
    """A linear layer in, ``blocks`` in a row, a linear layer out (the root's)."""

    def __init__(self, block, d: int, n: int = 2):
        super().__init__()
        self.inp = nn.Linear(13, d)
        self.blocks = nn.ModuleList(block(d) for _ in range(n))
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


MODELS = {
    "tied": (lambda: TiedTransformer(vocab=24), Block),
    "moe": (lambda: make("moe"), MoEBlock),
    "pair": (lambda: Stack(TiedPair, 12), TiedPair),
    "experts": (lambda: Stack(StackedExperts, 8), StackedExperts),
    "bare": (lambda: Stack(Bare, 12, 3), Bare),
}


@shardwise.placement.needs_whole_matrices
class BatchedMuon(torch.optim.Optimizer):
    """Muon over the trailing matrices of a parameter of any rank: stacked experts ``[E, a, b]``
    get one Newton–Schulz per expert matrix, batched."""

    def __init__(self, params, lr: float = 2e-2, momentum: float = 0.95):
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - group["momentum"])
                p.add_(orthogonalized(p.grad.lerp(buf, group["momentum"])), alpha=-group["lr"])


def _optimizers(model: nn.Module, whole: set[str], optimizer: str):
    """The whole-matrix optimizer on the parameters named ``whole``, AdamW on the rest."""
    params = dict(model.named_parameters())
    chosen = [params[n] for n in sorted(whole)]
    make_whole = {
        "muon": lambda ps: torch.optim.Muon(ps, lr=2e-2),
        "stock_muon": lambda ps: torch.optim.Muon(ps, lr=2e-2),
        "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=2e-2),
        "batched_muon": lambda ps: BatchedMuon(ps),
    }[optimizer]
    return [make_whole(chosen), torch.optim.AdamW([p for n, p in params.items() if n not in whole], lr=1e-2)]


def train_whole(
    kind: str,
    strategy: str = "full_shard",
    *,
    optimizer: str = "muon",
    placement=shardwise.placement.matrices,
    steps: int = 10,
    micro: int = 1,
    clip: float | None = None,
    checkpointing: bool = False,
    compile_blocks: bool = False,
    **options,
):
    """Train a sharded copy (``optimizer`` on the owned parameters, AdamW on the rest) and the
    unsharded reference (the same optimizers on the same parameters by name) on the same
    global batches. Returns on rank 0: both loss curves, the largest final difference, how far
    the reference moved, the owned names, and whether any shardwise collective ran in a step."""
    with fp32_newton_schulz() if optimizer == "muon" else contextlib.nullcontext():
        return _train_whole(kind, strategy, optimizer, placement, steps, micro, clip, checkpointing, compile_blocks, options)


def _train_whole(kind, strategy, optimizer, placement, steps, micro, clip, checkpointing, compile_blocks, options):
    build, block = MODELS[kind]
    torch.manual_seed(0)
    ref = build()
    start = copy.deepcopy(ref.state_dict())
    model = shardwise.shard(
        copy.deepcopy(ref), wrap=shardwise.wrap.by_class(block), strategy=strategy, placement=placement, **options
    )
    if checkpointing:
        shardwise.checkpoint_activations(model, shardwise.wrap.by_class(block))
    if compile_blocks:
        for b in model.blocks:
            b.compile()
    # the owned parameters, or where none are (stacks in rows: whole experts per rank) the stacks
    whole = {n for n, p in model.named_parameters() if shardwise.placement.is_owned(p)} or {
        n for n, p in model.named_parameters() if p.ndim >= 3
    }
    opts, ref_opts = _optimizers(model, whole, optimizer), _optimizers(ref, whole, optimizer)
    data = "tied" if kind == "tied" else "mlp"
    n = dist.get_world_size()
    losses, ref_losses, step_comm = [], [], 0
    for step in range(steps):
        x, y = batch(data, step, 2 * n * micro)
        if data == "tied":
            x, y = x % 24, y % 24
        total = ref_total = 0.0
        for i, (xi, yi) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            with contextlib.nullcontext() if i == micro - 1 else shardwise.no_sync(model):
                loss = loss_of(model, local_slice(xi), local_slice(yi)) / micro
                loss.backward()
            total += global_mean(loss)
            ref_loss = loss_of(ref, xi, yi) / micro
            ref_loss.backward()
            ref_total += ref_loss.item()
        if clip is not None:
            shardwise.clip_grad_norm_(model, clip)
            torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], clip)
        before = sum(s.calls for s in shardwise.comm_stats().values())
        for o in opts:
            o.step()
            o.zero_grad()
        step_comm += sum(s.calls for s in shardwise.comm_stats().values()) - before
        for o in ref_opts:
            o.step()
            o.zero_grad()
        losses.append(total)
        ref_losses.append(ref_total)
    compared = differences(model, ref, start)
    if compared is None:
        return None
    diff, moved = compared
    return losses, ref_losses, diff, moved, sorted(whole), step_comm


def check(result, *, tol: float = 1e-5, rel: float = 1e-5):
    losses, ref_losses, diff, moved, whole, step_comm = result
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert a == pytest.approx(b, rel=rel), f"step {step}: sharded {a} vs reference {b}"
    assert diff <= tol, f"largest difference from one process {diff:.3g} > {tol}"
    assert whole and max(moved[n] for n in whole) > 1e-2  # the whole-matrix optimizer trained
    assert step_comm == 0  # nothing communicated in opt.step()
    return moved, whole


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_muon_on_owned_matrices_trains_like_one_process(pools, world_size):
    _moved, whole = check(pools(world_size).run(train_whole, "tied")[0])
    # every matrix of the blocks is owned; the root's (embedding = head, positions) stay rows
    assert all(n.startswith("blocks.") and n.endswith(".weight") and "ln" not in n for n in whole)
    assert len(whole) == 3 * 4


@pytest.mark.parametrize(
    "strategy, options",
    [
        ("shard_grad_op", {}),
        ("no_shard", {}),  # whole on every rank anyway: placement changes nothing
        ("full_shard", {"cpu_offload": True}),
        ("full_shard", {"micro": 2, "clip": 0.05}),  # no_sync, and clipping that clips
        ("full_shard", {"checkpointing": True}),
    ],
)
def test_muon_across_strategies_and_options(pools, strategy, options):
    check(pools(2).run(train_whole, "tied", strategy, **options)[0])


def test_muon_under_hybrid_sharding(pools):
    check(pools(4).run(train_whole, "tied", "hybrid_shard", shard_size=2)[0])


def test_muon_with_bf16(pools):
    # 16-bit compute differs from the fp32 reference by bf16 rounding, not by the placement
    check(pools(2).run(train_whole, "tied", mixed_precision="bf16", steps=4)[0], tol=3e-2, rel=3e-2)


def test_muon_with_unused_experts_and_tied_weights_in_a_unit(pools):
    moved, whole = check(pools(2).run(train_whole, "moe", steps=6)[0])
    assert all(moved[n] == 0 for n in whole if ".experts.3." in n)  # routed nowhere: never stepped
    moved, whole = check(pools(3).run(train_whole, "pair", steps=6)[0])
    assert "blocks.0.a.weight" in whole and "blocks.0.b.weight" not in whole  # one tensor, one name


def stock_muon_owned_and_ddp(steps: int = 10):
    """Stock torch.optim.Muon (bf16 Newton–Schulz) on owned matrices under full_shard, and on
    the same matrices under no_shard (DDP), side by side; rank 0 gets both state dicts."""
    out = []
    for strategy in ("full_shard", "no_shard"):
        torch.manual_seed(0)
        model = shardwise.shard(
            TiedTransformer(vocab=24), wrap=shardwise.wrap.by_class(Block), strategy=strategy,
            placement=shardwise.placement.matrices,
        )
        whole = {n for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")}
        opts = _optimizers(model, whole, "stock_muon")
        for step in range(steps):
            x, y = batch("tied", step, 2 * dist.get_world_size())
            loss_of(model, local_slice(x % 24), local_slice(y % 24)).backward()
            for o in opts:
                o.step()
                o.zero_grad()
        out.append(shardwise.full_state_dict(model))
    return out if dist.get_rank() == 0 else None


def test_stock_muon_matches_ddp_bitwise(pools):
    owned, ddp = pools(2).run(stock_muon_owned_and_ddp)[0]
    assert all(torch.equal(owned[k], ddp[k]) for k in ddp)


def test_adafactor_is_exact_on_owned_matrices(pools):
    # its factored second moment averages over rows and over columns: a row slice changes both
    check(pools(2).run(train_whole, "tied", optimizer="adafactor")[0])


@pytest.mark.parametrize("placement", ["owned", "rows"])  # whole stacks, or whole experts per rank
def test_stacked_experts_get_one_newton_schulz_per_expert(pools, placement):
    # rows: dim 0 is the expert, so 4 experts over 2 ranks are 2 whole experts on each
    place = shardwise.placement.matrices if placement == "owned" else shardwise.placement.rows
    _, whole = check(pools(2).run(train_whole, "experts", optimizer="batched_muon", placement=place, steps=6)[0])
    assert {"blocks.0.up", "blocks.1.down"} <= set(whole)


# --- row placement must never be silently wrong
def step_split(optimizer: str):
    model = shardwise.shard(TiedTransformer(vocab=24), wrap=shardwise.wrap.by_class(Block))
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]
    opt = {"muon": torch.optim.Muon, "adafactor": torch.optim.Adafactor, "batched_muon": BatchedMuon}[optimizer](
        matrices, lr=1e-2
    )
    x, y = batch("tied", 0, 2)
    loss_of(model, x, y).backward()
    try:
        opt.step()
    except shardwise.ShardwiseError as e:
        return str(e)
    return None


@pytest.mark.parametrize("optimizer", ["muon", "adafactor", "batched_muon"])
def test_whole_matrix_optimizer_on_rows_raises(pools, optimizer):
    for message in pools(2).run(step_split, optimizer):
        assert message is not None, "a whole-matrix optimizer stepped row slices silently"
        assert "placement=shardwise.placement.matrices" in message and "blocks.0.attn.qkv.weight" in message


def test_owners_are_balanced_within_one_matrix():
    sizes = [[(36 * 12, True), (12, False), (12 * 12, True), (36 * 12, True), (12 * 36, True)]] * 3
    for world in (2, 3, 4):
        owners = choose_owners(sizes, world)
        load = [0] * world
        for unit, own in zip(sizes, owners):
            for (numel, owned), o in zip(unit, own):
                assert (o is None) == (not owned)
                if o is not None:
                    load[o] += numel
        assert max(load) - min(load) <= 36 * 12
        assert owners[0][0] != owners[0][3]  # a unit's largest matrices go to different ranks


# --- bytes: a mixed unit sends what theory says, summed over ranks
def bytes_per_step():
    model = shardwise.shard(
        TiedTransformer(vocab=24), wrap=shardwise.wrap.by_class(Block), placement=shardwise.placement.matrices
    )
    x, y = batch("tied", 0, 2 * dist.get_world_size())
    loss_of(model, local_slice(x % 24), local_slice(y % 24)).backward()  # first step: untimed
    shardwise.reset_comm_stats()
    loss_of(model, local_slice(x % 24), local_slice(y % 24)).backward()
    stats = shardwise.comm_stats()
    units = shardwise.units(model)
    blocks = sum(u.layout.numel for u in units if not u.is_root)
    root = units[-1].layout.numel
    return stats["all_gather"].bytes, stats["reduce_scatter"].bytes, blocks, root


@pytest.mark.parametrize("world_size", [2, 3])
def test_mixed_units_send_the_theory(pools, world_size):
    out = pools(world_size).run(bytes_per_step)
    gathered, reduced = sum(o[0] for o in out), sum(o[1] for o in out)
    _, _, blocks, root = out[0]
    n = world_size
    # (no padding at these sizes) each element goes to N-1 ranks: blocks twice (forward and
    # backward), the root once (it stays gathered into backward); every gradient once
    assert gathered == 4 * (n - 1) * (2 * blocks + root)
    assert reduced == 4 * (n - 1) * (blocks + root)
    per_rank = [o[0] for o in out]
    assert max(per_rank) - min(per_rank) <= 2 * 4 * 36 * 12  # within one matrix, both gathers


# --- checkpoints: saved owned, loaded owned or in rows at another world size, optimizer state too
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks


def checkpoint_leg(path: str, placement: str, optimizer: str, steps: range, save_at: int | None, load: bool):
    """Build the tied transformer with ``placement`` and its optimizers ("muon": Muon on the
    blocks' matrices and AdamW on the rest; "adamw": AdamW alone), load ``path`` if ``load``,
    train ``steps`` on the same global batches whatever the world size, save at ``save_at``;
    rank 0 gets the final full state dict."""
    with fp32_newton_schulz():
        torch.manual_seed(0)
        place = getattr(shardwise.placement, placement)
        model = shardwise.shard(TiedTransformer(vocab=24), wrap=shardwise.wrap.by_class(Block), placement=place)
        whole = {n for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")}
        if optimizer == "muon":
            opts = _optimizers(model, whole, "muon")
        else:
            opts = [torch.optim.AdamW(model.parameters(), lr=1e-2)]
        if load:
            shardwise.load(path, model, opts)
        for step in steps:
            x, y = batch("tied", step, GLOBAL_BATCH)
            loss_of(model, local_slice(x % 24), local_slice(y % 24)).backward()
            for o in opts:
                o.step()
                o.zero_grad()
            if step == save_at:
                shardwise.save(path, model, opts)
        return shardwise.full_state_dict(model)


@pytest.mark.parametrize(
    "saved, loaded",
    [
        ((2, "matrices", "muon"), (3, "matrices", "muon")),  # owned at another world size
        ((2, "matrices", "muon"), (1, "rows", "muon")),  # rows: whole at one rank
        ((3, "rows", "adamw"), (2, "matrices", "adamw")),  # rows to owned (AdamW's step and moments)
        ((2, "matrices", "adamw"), (4, "rows", "adamw")),  # owned to rows
    ],
)
def test_owned_checkpoints_resume_anywhere(pools, tmp_path, saved, loaded):
    path = str(tmp_path / "ckpt")
    (n, placement, optimizer), (m, placement_after, _) = saved, loaded
    straight = pools(n).run(checkpoint_leg, path, placement, optimizer, range(6), save_at=2, load=False)[0]
    resumed = pools(m).run(checkpoint_leg, path, placement_after, optimizer, range(3, 6), save_at=None, load=True)[0]
    assert max((straight[k] - v).abs().max().item() for k, v in resumed.items()) <= 1e-5


# --- the planner shows who owns what, as shard() lays it out
def real_owners():
    model = shardwise.shard(
        TiedTransformer(vocab=24), wrap=shardwise.wrap.by_class(Block), placement=shardwise.placement.matrices
    )
    return {s.name: s.owner for u in shardwise.units(model) for s in u.layout.slots if s.owned}


def test_plan_shows_the_owners_shard_chooses(pools):
    def inputs():
        return (torch.zeros(2, 6, dtype=torch.long),)

    p = shardwise.plan(
        lambda: TiedTransformer(vocab=24), world_size=3, strategy="full_shard",
        wrap=shardwise.wrap.by_class(Block), inputs=inputs, placement=shardwise.placement.matrices,
    )
    planned = {name: owner for u in p.estimates[0].units for name, owner, _ in u.owned}
    assert planned == pools(3).run(real_owners)[0] and len(planned) == 12
    # the bytes it predicts are the ranks' mean: (N-1)/N of every gathered and reduced element
    units = p.estimates[0].units
    blocks, root = sum(u.params for u in units if u.name != "<root>"), units[-1].params
    assert p.estimates[0].comm["all_gather"] == 4 * 2 * (2 * blocks + root) // 3
    assert p.estimates[0].comm["reduce_scatter"] == 4 * 2 * (blocks + root) // 3
    assert "blocks.0.attn.qkv.weight -> 0" in str(p)


@pytest.mark.parametrize("world_size", [3, 4])
def test_owned_edge_cases_train_like_one_process(pools, world_size):
    # prime sizes, a frozen layer, a 0-dim and a 1-element parameter, a matrix with fewer rows
    # than ranks, some ranks owning nothing of a unit: AdamW, every matrix owned
    losses, ref_losses, diff, moved = pools(world_size).run(
        train_pair, "mlp", "full_shard", "by_class", placement=shardwise.placement.matrices
    )[0]
    for a, b in zip(losses, ref_losses):
        assert a == pytest.approx(b, rel=1e-5)
    assert moved > 0.05 and diff <= 1e-5
    # units of one matrix: its owner sends it, the others send and receive empty messages
    check(pools(world_size).run(train_whole, "bare", steps=4)[0])
