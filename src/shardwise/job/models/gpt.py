"""A small byte-level GPT: pre-LayerNorm blocks, causal attention, a tied output head.

Meta-device contract: every parameter is initialised by its own leaf module's
``reset_parameters()``, and modules are constructed in ``named_modules()`` order. Calling
``reset_parameters()`` of each module in that order (giving a tied parameter's later owner
scratch storage) therefore redraws exactly the random stream of eager construction with the
same seed, which is how ``shardwise.shard`` initialises a model built under
``torch.device("meta")``. The model has no buffers, so a meta build holds only parameters.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

_INIT_STD = 0.02


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT; the defaults are the "small" size."""

    vocab_size: int = 256  # token ids are bytes
    seq_len: int = 128  # longest sequence; the size of the position embedding
    d_model: int = 384  # width of the residual stream
    n_layer: int = 6  # number of blocks
    n_head: int = 6  # attention heads per block; must divide d_model
    mlp_ratio: int = 4  # MLP hidden width as a multiple of d_model

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")


# Measured num_params: tiny 101,632; small 10,788,096; medium 31,706,112; large 99,494,400.
# tiny's MLP is 3x wide, not 4x (which would give 118,144), to land near 0.1M.
GPT_SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(seq_len=32, d_model=64, n_layer=2, n_head=4, mlp_ratio=3),
    "small": GPTConfig(d_model=384, n_layer=6, n_head=6),
    "medium": GPTConfig(d_model=512, n_layer=10, n_head=8),
    "large": GPTConfig(d_model=768, n_layer=14, n_head=12),
}


def gpt_config(size: str, **overrides) -> GPTConfig:
    """The config of a named size, with some fields replaced (e.g. ``seq_len=256``)."""
    if size not in GPT_SIZES:
        raise ValueError(f"unknown GPT size {size!r}; valid sizes: {', '.join(GPT_SIZES)}")
    return dataclasses.replace(GPT_SIZES[size], **overrides)


class _Linear(nn.Linear):
    """nn.Linear with GPT initialisation: weight ~ N(0, 0.02), zero bias."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, 0.0, _INIT_STD)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class _Embedding(nn.Embedding):
    """nn.Embedding with GPT initialisation: weight ~ N(0, 0.02)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, 0.0, _INIT_STD)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused query/key/value projection."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        # no qkv bias: the key bias gets an exactly-zero gradient (it shifts every score of a
        # row equally), and Adam would turn that zero's rounding noise into full-size steps
        self.qkv = _Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = _Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """Position-wise feed-forward: Linear, GELU, Linear."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = _Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = _Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``n_layer`` blocks, a final LayerNorm and a head tied to
    the token embedding."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = _Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = _Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = _Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied: the head's own draw is discarded

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of shape (batch, time, vocab), or the mean cross-entropy if ``targets``."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of length {t} is longer than seq_len={self.cfg.seq_len}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def num_params(model: nn.Module) -> int:
    """Number of parameter elements, each shared (tied) parameter counted once."""
    return sum(p.numel() for p in model.parameters())  # parameters() yields a shared one once
