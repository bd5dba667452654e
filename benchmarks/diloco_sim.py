"""One-process simulation of DiLoCo against exact data parallelism, with the shipped codecs:
a screen for outer-optimizer recipes before the real bench decides (docs/fault_tolerance.md,
"Top-k's recipe").

    python benchmarks/diloco_sim.py --comm topk --outer-momentum 0.8 --warmup-steps 256 --seed 0

The tiny GPT on the offline corpus, 16 rows of 64 tokens a step, AdamW. ``--comm exact``
trains one model on all 16 rows. Otherwise ``--warmup-steps`` exact steps, then two groups of
8 rows each take ``--sync-every`` inner steps and average their pseudo-gradients, each
group's two "ranks" encoding their half of it (fp32, ``int8`` or ``topk``, with a residual
each: error feedback), and an outer Nesterov SGD steps the global parameters. Prints the mean
loss of the last ``--tail`` steps (and every step's loss) as JSON. The real runs are slower
and differ in data order across ranks; compare settings within one column of seeds.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

from shardwise.core.codecs import Codec
from shardwise.ft.topk import TopK2Bit
from shardwise.job.data import get_batch
from shardwise.job.models import GPT, gpt_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--comm", choices=("exact", "fp32", "int8", "topk"), default="topk")
    p.add_argument("--steps", type=int, default=2048)
    p.add_argument("--sync-every", type=int, default=32)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--warmup-steps", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--tail", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    model = GPT(gpt_config("tiny", seq_len=64, vocab_size=256))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    losses = []

    def step(m, o, rows, s):
        x, y = get_batch(s, 16, 64, seed=a.seed)
        o.zero_grad()
        loss = m(x[rows], y[rows])
        loss.backward()
        o.step()
        return loss.item()

    every = slice(0, 16)
    for s in range(a.steps if a.comm == "exact" else a.warmup_steps):
        losses.append(step(model, opt, every, s))
    if a.comm != "exact":
        codec = {"fp32": None, "int8": Codec("int8"), "topk": TopK2Bit()}[a.comm]
        groups = [copy.deepcopy(model) for _ in range(2)]
        opts = [torch.optim.AdamW(m.parameters(), lr=a.lr) for m in groups]
        for o in opts:
            o.load_state_dict(opt.state_dict())
        glob = [torch.nn.Parameter(q.detach().clone()) for q in model.parameters()]
        outer = torch.optim.SGD(glob, lr=a.outer_lr, momentum=a.outer_momentum, nesterov=a.outer_momentum > 0)
        n = sum(g.numel() for g in glob)
        halves = [(0, n // 2), (n // 2, n)]
        residuals = [[torch.zeros(hi - lo) for lo, hi in halves] for _ in groups]
        for s in range(a.warmup_steps, a.steps):
            losses.append(sum(step(m, o, slice(8 * i, 8 * i + 8), s) for i, (m, o) in enumerate(zip(groups, opts))) / 2)
            if (s - a.warmup_steps + 1) % a.sync_every:
                continue
            with torch.no_grad():
                average = torch.zeros(n)
                for i, m in enumerate(groups):
                    pseudo = torch.cat([(g - q).flatten() for g, q in zip(glob, m.parameters())])
                    for r, (lo, hi) in enumerate(halves):
                        if codec is None:
                            sent = pseudo[lo:hi]
                        else:
                            keep = pseudo[lo:hi] + residuals[i][r]
                            sent = codec.decode(codec.encode(keep), hi - lo)
                            residuals[i][r] = keep - sent
                        average[lo:hi] += sent / len(groups)
                offset = 0
                for g in glob:
                    g.grad = average[offset : offset + g.numel()].view_as(g).clone()
                    offset += g.numel()
                outer.step()
                outer.zero_grad()
                for m in groups:
                    for g, q in zip(glob, m.parameters()):
                        q.copy_(g)
    print(json.dumps({"args": vars(a), "tail": sum(losses[-a.tail :]) / a.tail, "losses": losses}))


if __name__ == "__main__":
    main()
