"""Fine-tune a small Hugging Face causal LM with shardwise, export it, and load it back.

    torchrun --nproc_per_node 2 examples/finetune_hf.py --out runs/full
    torchrun --nproc_per_node 2 examples/finetune_hf.py --out runs/lora --lora --init-from runs/full

The model is a Llama from a transformers config over bytes (vocabulary 256, random weights:
nothing is downloaded), or the ``from_pretrained`` directory given in --init-from (such as an
earlier run's export). It is built on the meta device and sharded with
``shardwise.wrap.auto``; with --init-from each rank reads only its rows of every weight, so a
model larger than one rank's memory loads. With --lora, peft's LoRA adapters are trained and
the base stays frozen. It trains on shardwise's offline corpus; then
``shardwise.save_pretrained`` writes --out, and rank 0 loads that with
``AutoModelForCausalLM.from_pretrained`` (which attaches a LoRA adapter by itself) and checks
that it gives the sharded model's loss. Needs ``pip install "shardwise[hf]"``.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

import shardwise
from shardwise.job.data import get_batch, rank_slice


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for the exported model")
    p.add_argument("--init-from", help="a from_pretrained directory to start from")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (peft) only")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def build(args: argparse.Namespace) -> torch.nn.Module:
    if args.init_from:
        config = AutoConfig.from_pretrained(args.init_from)
    else:
        config = LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len,
            tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
        )
    with torch.device("meta"):  # no memory yet: shard() fills only this rank's rows
        model = AutoModelForCausalLM.from_config(config)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = get_peft_model(model, lora)
        init_adapters(model)
    return model


def init_adapters(model: torch.nn.Module) -> None:
    """peft makes a meta model's adapters on the meta device too, where its initialisation
    (B = 0, so that training starts from the base model) cannot run: give the adapters real
    storage and run it. The base weights stay on the meta device for shard() to fill."""
    from peft.tuners.lora import LoraLayer

    for layer in model.modules():
        if isinstance(layer, LoraLayer):
            for name in layer.lora_A:
                layer.lora_A[name].to_empty(device="cpu")
                layer.lora_B[name].to_empty(device="cpu")
                layer.reset_lora_parameters(name, True)


def loss_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss  # transformers shifts the labels itself


def main() -> None:
    args = parse_args()
    shardwise.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = shardwise.core.groups.device()
    torch.manual_seed(args.seed)
    model = build(args)
    shardwise.shard(model, wrap=shardwise.wrap.auto(model), init_from=args.init_from)
    trainable = [p for p in model.parameters() if p.requires_grad]  # the adapters, with --lora
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    if rank == 0:
        total = sum(p.numel() for p in model.parameters()) * world
        print(f"{type(model).__name__}, units {shardwise.wrap.auto(model)}, about {total:,} "
              f"parameters ({sum(p.numel() for p in trainable) * world:,} trained), {world} ranks")
    for step in range(args.steps):
        x, _ = get_batch(step, args.batch_size * world, args.seq_len, seed=args.seed)
        loss = loss_of(model, rank_slice(x, rank, world).to(device))
        loss.backward()
        shardwise.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == args.steps - 1:
            t = loss.detach().clone()
            dist.all_reduce(t)
            if rank == 0:
                print(f"step {step:4d}  loss {t.item() / world:.4f}", flush=True)

    shardwise.save_pretrained(model, args.out)
    x, _ = get_batch(0, 2, args.seq_len, seed=args.seed, split="val")
    with torch.no_grad():  # every rank the same batch: the sharded model's loss on it
        sharded = loss_of(model, x.to(device)).item()
    if rank == 0:
        reloaded = AutoModelForCausalLM.from_pretrained(args.out).to(device)
        with torch.no_grad():
            again = loss_of(reloaded, x.to(device)).item()
        print(f"exported to {args.out}; reloaded with from_pretrained: val loss {again:.6f} "
              f"(sharded {sharded:.6f})", flush=True)
        if not math.isclose(again, sharded, rel_tol=1e-5):
            raise SystemExit("the reloaded model does not give the sharded model's loss")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
