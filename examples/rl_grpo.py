"""GRPO on a small model: vLLM generates the rollouts, shardwise trains, and every step's new
weights go into the running engine before the next rollouts.

    torchrun --nproc_per_node 2 examples/rl_grpo.py --steps 40 --plot docs/rl_grpo.png
    torchrun --nproc_per_node 2 examples/rl_grpo.py --engine http://127.0.0.1:8000   # vllm serve

The policy is a Llama from a transformers config (random weights, nothing downloaded), written
with save_pretrained for vLLM to load. Rank 0 runs the engine (an in-process ``vllm.LLM``,
CPU here) or talks to a ``vllm serve`` that loaded the same directory; every rank trains its
shard. The task: after a prompt of random tokens, write target tokens (the first quarter of
the vocabulary); the reward is the fraction of the completion that is (0.25 by chance). Each step: G samples per prompt from the
engine (with the logprobs it sampled them at), advantages normalised within each group,
the clipped policy-gradient loss on each rank's share of the sequences, ``opt.step()``, then
``sync.push()``. Needs ``pip install "shardwise[vllm,hf,tools]"``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import shardwise
import shardwise.rl

VOCAB, PROMPT_LEN = 64, 6


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--engine", help="URL of a vllm serve that loaded --workdir/policy (default: vllm.LLM on rank 0)")
    p.add_argument("--workdir", default="runs/rl_grpo", help="where the initial policy is written")
    p.add_argument("--delta", action="store_true", help="push only the values that changed")
    p.add_argument("--plot", help="write the reward curve here (PNG, matplotlib)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def policy_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
    )


def reward(prompt: list[int], completion: list[int]) -> float:
    """The fraction of the completion's tokens that are target tokens (the first quarter of
    the vocabulary), whatever the prompt."""
    return sum(t < VOCAB // 4 for t in completion) / len(completion)


def start_engine(args: argparse.Namespace, path: Path):
    """Rank 0's engine: the server's URL, or an in-process LLM running the shardwise backend."""
    if args.engine:
        return args.engine
    from vllm import LLM

    return LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=64,
               enforce_eager=True, seed=args.seed, weight_transfer_config={"backend": "shardwise"})


def rollouts(engine, prompts: list[list[int]], args: argparse.Namespace, step: int):
    """G completions per prompt, the logprob each sampled token had, and the weight version
    that generated them."""
    if isinstance(engine, str):
        import requests

        out = []
        for p in prompts:
            body = {"token_ids": p, "sampling_params": {
                "n": args.group, "max_tokens": args.new_tokens, "temperature": 1.0, "logprobs": 0,
                "ignore_eos": True, "seed": args.seed * 100_000 + step * 100 + len(out)}}
            r = requests.post(f"{engine}/inference/v1/generate", json=body, timeout=120)
            r.raise_for_status()
            for c in r.json()["choices"]:
                out.append((c["token_ids"], [x["logprob"] for x in c["logprobs"]["content"]],
                            c["weight_versions"][0]["version"]))
        return out
    from vllm import SamplingParams

    params = SamplingParams(n=args.group, max_tokens=args.new_tokens, temperature=1.0, logprobs=0,
                            ignore_eos=True, seed=args.seed * 1000 + step)
    results = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    version = engine.get_weight_version()
    return [
        (list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)], version)
        for r in results for c in r.outputs
    ]


def grpo_loss(model, seqs: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, clip: float) -> torch.Tensor:
    """The clipped surrogate over the completion tokens: the ratio of the policy's probability
    to the one the engine sampled at, times the sequence's advantage."""
    logits = model(input_ids=seqs).logits[:, PROMPT_LEN - 1 : -1].float()
    new = torch.log_softmax(logits, -1).gather(-1, seqs[:, PROMPT_LEN:, None]).squeeze(-1)
    ratio = torch.exp(new - old)
    a = adv[:, None]
    return -torch.min(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a).mean()


def main() -> None:
    args = parse_args()
    shardwise.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    from transformers import AutoModelForCausalLM

    path = Path(args.workdir) / "policy"
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(policy_config())  # the same weights on every rank
    if rank == 0:
        model.save_pretrained(path)  # what the engine starts from
    dist.barrier()
    engine = start_engine(args, path) if rank == 0 else None
    shardwise.shard(model, wrap=shardwise.wrap.auto(model))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sync = shardwise.rl.VLLMSync(model, engine, delta=args.delta)
    sync.push()  # the engine serves the trainer's weights (bf16 on the wire) from the first step
    g = torch.Generator().manual_seed(args.seed)
    curve = []
    for step in range(args.steps):
        prompts = torch.randint(0, VOCAB, (args.prompts, PROMPT_LEN), generator=g).tolist()
        batch = [None]
        if rank == 0:
            t0 = time.perf_counter()
            samples = rollouts(engine, prompts, args, step)
            batch = [(samples, time.perf_counter() - t0)]
        dist.broadcast_object_list(batch, src=0)
        samples, gen_s = batch[0]
        rewards = torch.tensor([reward(prompts[i // args.group], s[0]) for i, s in enumerate(samples)])
        groups = rewards.view(args.prompts, args.group)
        adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)
        seqs = torch.tensor([prompts[i // args.group] + s[0] for i, s in enumerate(samples)])
        old = torch.tensor([s[1] for s in samples])
        mine = slice(rank * len(samples) // world, (rank + 1) * len(samples) // world)
        loss = grpo_loss(model, seqs[mine], old[mine], adv[mine], args.clip)
        loss.backward()
        shardwise.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        t0 = time.perf_counter()
        version = sync.push()
        push_s = time.perf_counter() - t0
        curve.append(rewards.mean().item())
        if rank == 0:
            print(f"step {step:3d}  reward {curve[-1]:.3f}  rollouts from version {samples[0][2]}  "
                  f"generate {gen_s:.2f}s  push v{version} {push_s * 1e3:.0f} ms", flush=True)
    stats = shardwise.comm_stats()["weight_sync"]
    if rank == 0:
        first, last = sum(curve[:5]) / 5, sum(curve[-5:]) / 5
        print(f"reward {first:.3f} -> {last:.3f} (mean of the first and last 5 steps); "
              f"{stats.calls} pushes, {stats.bytes / stats.calls / 2**20:.2f} MiB each")
        if args.plot:
            plot(curve, args.plot)
    sync.close()
    dist.barrier()
    dist.destroy_process_group()


def plot(curve: list[float], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(range(len(curve)), curve, marker=".", lw=1)
    ax.axhline(0.25, color="grey", ls=":", lw=1, label="chance")
    ax.set_xlabel("GRPO step (rollouts by vLLM from the weights pushed after the step before)")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left")
    ax.set_title("examples/rl_grpo.py: shardwise at N=2, vLLM on CPU", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":  # vLLM spawns its engine process: everything runs from here
    main()
