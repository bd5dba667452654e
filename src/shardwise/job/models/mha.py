"""A GPT of stock torch modules: ``nn.MultiheadAttention`` blocks, an untied head, and a
forward that returns logits, the loss being the caller's. shardwise's own code never shaped
it, so benchmarks and tests use it to check claims made on the built-in GPT ("any
transformer"). It takes the built-in GPT's ``GPTConfig`` for its sizes.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .gpt import GPTConfig


class MHABlock(nn.Module):
    """Pre-LayerNorm block: x + attention(ln(x)) under a causal mask, then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, cfg.n_head, batch_first=True)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(
            nn.Linear(d, cfg.mlp_ratio * d), nn.GELU(), nn.Linear(cfg.mlp_ratio * d, d)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class MHAGPT(nn.Module):
    """Token and position embeddings, ``n_layer`` ``MHABlock``s, a final LayerNorm and an
    untied linear head; ``forward(idx)`` returns logits of shape (batch, time, vocab)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(MHABlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of length {t} is longer than seq_len={self.cfg.seq_len}")
        mask = torch.ones(t, t, dtype=torch.bool, device=idx.device).triu(1)  # True: masked
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))
