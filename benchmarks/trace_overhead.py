"""The tracer's overhead: CPU time per step with ``shardwise.trace`` off and on, interleaved.

    python benchmarks/trace_overhead.py --rounds 10

One process (world size 1, Gloo), the small GPT wrapped per block, 8 x 128 tokens a step,
AdamW, one intra-op thread. Each round times ``--steps`` steps without the tracer and as many
inside one ``shardwise.trace`` (events and memory by category, its final replay included),
in alternating order; it prints the median over rounds of each and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import shardwise
from shardwise.core import groups
from shardwise.job.models import GPT, Block, gpt_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=3, help="steps per timed block")
    a = p.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    groups.init()
    torch.manual_seed(0)
    model = shardwise.shard(GPT(gpt_config("small", seq_len=128)), wrap=shardwise.wrap.by_class(Block))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 256, (8, 129), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def block() -> float:
        t0 = time.process_time()
        for _ in range(a.steps):
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        return (time.process_time() - t0) / a.steps

    block()  # warm-up: optimizer state, first-step orders
    off, on = [], []
    for r in range(a.rounds):
        for traced in (False, True) if r % 2 == 0 else (True, False):
            if traced:
                t0 = time.process_time()
                with shardwise.trace(model, opt):
                    block()
                on.append((time.process_time() - t0) / a.steps)
            else:
                off.append(block())
    m_off, m_on = statistics.median(off), statistics.median(on)
    print(f"CPU ms per step: off {1e3 * m_off:.1f}, traced {1e3 * m_on:.1f} ({m_on / m_off - 1:+.1%}); {a.rounds} rounds x {a.steps} steps")


if __name__ == "__main__":
    main()
