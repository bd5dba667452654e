"""Tiny transformers models, built from configs (nothing is downloaded), and what the Hugging
Face tests run on every rank of a pool: training against a single-process reference,
generation, export with ``save_pretrained`` and loading a ``from_pretrained`` directory."""

from __future__ import annotations

import copy
import inspect
import warnings
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import shardwise

VOCAB, SEQ = 96, 8
LORA_TARGETS = ["q_proj", "v_proj"]


def build(kind: str, seed: int = 0) -> nn.Module:
    """``gpt2`` (tied head), ``llama`` (untied, grouped-query attention), ``llama_tied``,
    ``bert`` (masked LM, tied decoder) or ``llama_lora`` (peft LoRA on q and v); no dropout."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = tf.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1,
        )
        return tf.GPT2LMHeadModel(cfg)
    if kind in ("llama", "llama_tied", "llama_lora"):
        cfg = tf.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
            tie_word_embeddings=kind == "llama_tied", bos_token_id=0, eos_token_id=1,
            pad_token_id=2,
        )
        model = tf.LlamaForCausalLM(cfg)
        if kind == "llama_lora":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(
                model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, lora_dropout=0.0)
            )
        return model
    if kind == "bert":
        cfg = tf.BertConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
            vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        return tf.BertForMaskedLM(cfg)
    raise ValueError(kind)


def tokens(step: int, global_batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(3, VOCAB, (global_batch, SEQ), generator=g)


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Every position has a label (the MLM reconstructs every token), so each rank's mean is
    over as many tokens as every other's and their mean is the global batch's."""
    return model(input_ids=ids, labels=ids).loss


def rank_rows(t: torch.Tensor) -> torch.Tensor:
    per = t.shape[0] // dist.get_world_size()
    return t[dist.get_rank() * per : (dist.get_rank() + 1) * per]


def sharded_copy(ref: nn.Module, placement=None) -> nn.Module:
    model = copy.deepcopy(ref)
    return shardwise.shard(model, wrap=shardwise.wrap.auto(model), placement=placement)


def train_pair(kind: str, steps: int = 4, per_rank: int = 2, lr: float = 0.2):
    """Train the sharded model and its unsharded reference on one global batch per step, with
    SGD (momentum), the optimizer built from the trainable parameters only. Returns on rank 0:
    the policy chosen, both loss curves, the largest final difference, how far the reference
    moved, and the names of the parameters that have optimizer state."""
    ref = build(kind)
    start = copy.deepcopy(ref.state_dict())
    model = sharded_copy(ref)
    policy = repr(shardwise.wrap.auto(model))

    def sgd(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=lr, momentum=0.9)

    opt, ref_opt = sgd(model), sgd(ref)
    n = dist.get_world_size()
    losses, ref_losses = [], []
    for step in range(steps):
        ids = tokens(step, per_rank * n)
        loss = loss_of(model, rank_rows(ids))
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / n)
        ref_loss = loss_of(ref, ids)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    names = {id(p): name for name, p in model.named_parameters()}
    with_state = sorted(names[id(p)] for p in opt.state)
    full = shardwise.full_state_dict(model)
    if dist.get_rank() != 0:
        return None
    ref_sd = ref.state_dict()
    floats = [k for k, v in ref_sd.items() if v.is_floating_point()]
    diff = max((full[k] - ref_sd[k]).abs().max().item() for k in floats)
    moved = max((start[k] - ref_sd[k]).abs().max().item() for k in floats)
    return policy, losses, ref_losses, diff, moved, with_state


def generate_pair(kind: str):
    """Generate with the sharded model (its ``generate`` registered as a forward method) and
    with the reference, from a different prompt on each rank: greedy, sampled (same seed) and
    beam search, with ``synced_gpus`` so that a rank that is done keeps joining the gathers.
    Returns whether each matched, and whether the signature survived registration."""
    ref = build(kind).eval()
    model = sharded_copy(ref)
    shardwise.register_forward_method(model, "generate")
    g = torch.Generator().manual_seed(7 + dist.get_rank())  # each rank its own prompts
    ids = torch.randint(3, VOCAB, (2, 5), generator=g)
    options = {
        "greedy": {"do_sample": False},
        "sampled": {"do_sample": True, "top_k": 20, "top_p": 0.9, "temperature": 0.8},
        "beams": {"do_sample": False, "num_beams": 2},
    }
    same = {}
    for name, opts in options.items():
        outs = []
        for m, sync in ((model, True), (ref, False)):
            torch.manual_seed(3)
            outs.append(m.generate(ids, max_new_tokens=6, pad_token_id=2, synced_gpus=sync, **opts))
        same[name] = torch.equal(outs[0], outs[1])
    signature = inspect.signature(model.generate) == inspect.signature(ref.generate)
    return same, signature, model.generate.__doc__ == ref.generate.__doc__


def export_round_trip(kind: str, out: str, dtype: torch.dtype | None, max_shard_bytes: int, placement=None):
    """Train the sharded model two steps, export it, and load the export unsharded on rank 0
    with transformers (and peft). Returns the files written and the checks: every tensor of
    the loaded model equals the sharded model's (cast to ``dtype``) bit for bit, and no unit's
    full parameters were still held when the next unit was gathered."""
    import transformers as tf

    model = sharded_copy(build(kind), placement=placement)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.2)
    for step in range(2):
        loss_of(model, rank_rows(tokens(step, 2 * dist.get_world_size()))).backward()
        opt.step()
        opt.zero_grad()
    alive, most = [], 0  # the gathered units still held whenever another is gathered

    def watched(unit):
        def gather_full():
            nonlocal most
            most = max(most, sum(r() is not None for r in alive))
            full = original()
            alive.append(weakref.ref(full[0]))
            return full

        original = unit.gather_full
        return gather_full

    refused = False
    try:
        shardwise.save_pretrained(model, out, dtype=torch.int8)
    except shardwise.ShardwiseError as e:
        refused = "floating-point" in str(e)
    for unit in shardwise.units(model):
        unit.gather_full = watched(unit)
    shardwise.save_pretrained(model, out, dtype=dtype, max_shard_bytes=max_shard_bytes)
    for unit in shardwise.units(model):
        del unit.gather_full
    full = shardwise.full_state_dict(model)
    if dist.get_rank() != 0:
        return None
    auto = tf.AutoModelForMaskedLM if kind == "bert" else tf.AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = auto.from_pretrained(out)  # a peft export: the base, with the adapter attached
    want = {k.removeprefix("base_model.model."): v for k, v in full.items()}
    got = loaded.state_dict()
    cast = dtype or next(iter(want.values())).dtype
    checks = {"names": sorted(got) == sorted(want)}
    checks["values"] = checks["names"] and all(
        torch.equal(got[k], v.to(cast) if v.is_floating_point() else v) for k, v in want.items()
    )
    checks["dtype"] = all(v.dtype == cast for v in got.values() if v.is_floating_point())
    checks["one unit at a time"] = most == 0 and len(alive) >= len(shardwise.units(model))
    checks["int8 refused"] = refused
    if kind == "llama_lora":
        from peft import PeftModel

        base = tf.AutoModelForCausalLM.from_config(loaded.config)
        adapted = PeftModel.from_pretrained(base, out).state_dict()
        lora = [k for k in full if "lora_" in k]
        checks["peft"] = bool(lora) and all(torch.equal(adapted[k], full[k].to(cast)) for k in lora)
    return sorted(p.name for p in Path(out).iterdir()), checks


def load_pretrained_dir(kind: str, out: str, base_only: bool):
    """Rank 0 writes the reference with transformers' own ``save_pretrained`` (several
    files; with ``base_only`` just its base model, e.g. a LlamaModel for a LlamaForCausalLM);
    every rank builds the model on the meta device and shards it with ``init_from``. Returns
    whether the sharded model equals the reference bit for bit, and the warnings raised."""
    ref = build(kind)
    if dist.get_rank() == 0:
        (ref.base_model if base_only else ref).save_pretrained(out, max_shard_size="20KB")
    dist.barrier()
    with torch.device("meta"):
        model = type(ref)(ref.config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shardwise.shard(model, wrap=shardwise.wrap.auto(model), init_from=out)
    full = shardwise.full_state_dict(model)
    buffers_ok = all(
        torch.equal(b, dict(ref.named_buffers())[n]) for n, b in model.named_buffers()
    )
    if dist.get_rank() != 0:
        return None
    same = all(torch.equal(full[k], v) for k, v in ref.state_dict().items())
    ours = [str(w.message) for w in caught]
    return same, buffers_ok, [m for m in ours if "has no values" in m or "does not use" in m]
