"""Small models the tests train, and the single-process reference they are compared with."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shardwise


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        # no qkv bias: the key bias has an exactly-zero gradient, and Adam would amplify the
        # rounding noise of that zero into full-size steps that differ between runs
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 3 * d)
        self.out = nn.Linear(3 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TiedTransformer(nn.Module):
    """A transformer whose output head shares the token embedding (two modules, one weight)."""

    def __init__(self, vocab: int = 23, d: int = 12, layers: int = 3, heads: int = 2, seq: int = 6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.1)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


class Layer(nn.Module):
    def __init__(self, i: int, o: int):
        super().__init__()
        self.lin = nn.Linear(i, o)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class PrimeMLP(nn.Module):
    """Prime-sized layers, a frozen layer, a 0-dim and a 1-element parameter, and a layer with
    fewer rows than ranks."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer(13, 17), Layer(17, 11), Layer(11, 7), Layer(7, 2)])
        self.layers[1].requires_grad_(False)
        self.gain = nn.Parameter(torch.tensor(1.25))  # 0-dim
        self.shift = nn.Parameter(torch.tensor([0.1]))  # 1 element
        self.out = nn.Linear(2, 3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x * self.gain + self.shift)


class Expert(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoEBlock(nn.Module):
    """A mixture of experts inside one unit: a learned gate routes each row to its top ``k``
    experts, so which experts train depends on the data and differs between ranks; the last
    expert can never be chosen (idle everywhere, as an expert that no token picks)."""

    def __init__(self, d: int, experts: int = 4, k: int = 1):
        super().__init__()
        self.k = k
        self.ln = nn.LayerNorm(d)
        self.gate = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(Expert(d) for _ in range(experts))

    def forward(self, x):
        h = self.ln(x)
        scores = self.gate(h)
        scores[:, -1] = float("-inf")
        weights, chosen = scores.softmax(-1).topk(self.k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():  # an idle expert is not called: its parameters get no gradient
                out = out.index_add(0, rows, expert(h[rows]) * weights[rows, slot, None])
        return x + out


class MoENet(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.inp = nn.Linear(13, d)
        self.blocks = nn.ModuleList([MoEBlock(d, k=1), MoEBlock(d, k=2)])
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


class DoubleLinear(nn.Module):
    """PyTorch's own test module for unused parameters: its second output is never in the loss."""

    def __init__(self, d: int):
        super().__init__()
        self.lin1 = nn.Linear(d, d)
        self.lin2 = nn.Linear(d, d)

    def forward(self, x):
        return torch.relu(self.lin1(x)), torch.relu(self.lin2(x))


class DoubleStack(nn.Module):
    """DoubleLinear blocks, and a branch in the root that runs only while ``use_branch``."""

    def __init__(self, d: int = 8, layers: int = 3):
        super().__init__()
        self.inp = nn.Linear(13, d)
        self.blocks = nn.ModuleList(DoubleLinear(d) for _ in range(layers))
        self.branch = nn.Linear(d, d)
        self.out = nn.Linear(d, 3)
        self.use_branch = True

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x, _ = b(x)
        if self.use_branch:
            x = x + self.branch(x)
        return self.out(x)


MODELS = {"tied": TiedTransformer, "mlp": PrimeMLP, "moe": MoENet, "double": DoubleStack}
BLOCKS = {"tied": Block, "mlp": Layer, "moe": MoEBlock, "double": DoubleLinear}


def make(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[kind]()


def batch(kind: str, step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable task: next token = token + 1 (tied), a fixed linear teacher's argmax (others)."""
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "tied":
        x = torch.randint(0, 23, (global_batch, 6), generator=g)
        return x, (x + 1) % 23
    x = torch.randn(global_batch, 13, generator=g)
    teacher = torch.randn(13, 3, generator=torch.Generator().manual_seed(5))
    return x, (x @ teacher).argmax(-1)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def wrap_policy(name: str, kind: str):
    if name == "by_class":
        return shardwise.wrap.by_class(BLOCKS[kind])
    if name == "by_size":
        return shardwise.wrap.by_size({"tied": 150, "mlp": 40, "moe": 300, "double": 60}[kind])
    return None


def local_slice(t: torch.Tensor) -> torch.Tensor:
    r, n = dist.get_rank(), dist.get_world_size()
    per = t.shape[0] // n
    return t[r * per : (r + 1) * per]


def global_mean(loss: torch.Tensor) -> float:
    t = loss.detach().clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def counted_steps(model: nn.Module, steps: int = 2) -> dict:
    """SGD steps of the tied model on fixed batches; ``comm_stats()`` of the last ``steps``
    (the first step learns the orders and is not counted)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps + 1):
        if step == 1:
            shardwise.reset_comm_stats()
        x, y = batch("tied", step, 8)
        loss_of(model, local_slice(x), local_slice(y)).backward()
        opt.step()
        opt.zero_grad()
    return shardwise.comm_stats()


def differences(model: nn.Module, ref: nn.Module, start: dict) -> tuple[float, dict[str, float]] | None:
    """On rank 0 (None elsewhere; collective): the largest difference between the sharded
    model's final parameters and the reference's, and how far each reference tensor moved
    from ``start``, by name (so a comparison is of real training)."""
    full = shardwise.full_state_dict(model)
    if dist.get_rank() != 0:
        return None
    end = ref.state_dict()
    diff = max((full[k] - v).abs().max().item() for k, v in end.items())
    return diff, {k: (start[k] - v).abs().max().item() for k, v in end.items()}


def train_pair(
    kind: str, strategy: str, wrap: str, steps: int = 10, per_rank: int = 2, lr: float = 1e-2, **options
):
    """Train a sharded copy and the unsharded reference side by side on the same global batch
    (``options`` go to ``shard()``).

    Returns on rank 0: sharded losses, reference losses, the largest difference between final
    parameters, and how far the reference parameters moved from their start (so the
    comparison is of real training).
    """
    ref = make(kind)
    start = copy.deepcopy(ref.state_dict())
    model = shardwise.shard(copy.deepcopy(ref), wrap=wrap_policy(wrap, kind), strategy=strategy, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    n = dist.get_world_size()
    losses, ref_losses = [], []
    for step in range(steps):
        x, y = batch(kind, step, per_rank * n)
        loss = loss_of(model, local_slice(x), local_slice(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
        ref_loss = loss_of(ref, x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    full = shardwise.full_state_dict(model)
    if dist.get_rank() != 0:
        return None
    diff = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    moved = max((start[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return losses, ref_losses, diff, moved
