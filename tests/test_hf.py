"""Hugging Face models end to end at N=2, each wrapped by ``wrap.auto``: training equals one
process, ``generate`` equals the unsharded model's, ``save_pretrained`` is loaded back by
transformers and peft bit for bit, and a ``from_pretrained`` directory loads into a model built
on the meta device. Models are tiny and built from configs (hf_nets.py); nothing is downloaded."""

import inspect
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from hf_nets import export_round_trip, generate_pair, load_pretrained_dir, train_pair
from nets import PrimeMLP, TiedTransformer

import shardwise

POLICIES = {
    "gpt2": "by_class(GPT2Block)",
    "llama": "by_class(LlamaDecoderLayer)",
    "llama_tied": "by_class(LlamaDecoderLayer)",
    "bert": "by_class(BertEmbeddings, BertLayer)",
    "llama_lora": "by_class(LlamaDecoderLayer)",
}


@pytest.mark.parametrize("kind", list(POLICIES))
def test_training_equals_one_process(pools, kind):
    policy, losses, ref_losses, diff, moved, with_state = pools(2).run(train_pair, kind)[0]
    assert policy == POLICIES[kind]
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), (step, losses, ref_losses)
    assert moved > 1e-2 and diff < 1e-5, (diff, moved)
    if kind == "llama_lora":  # the optimizer holds state for the adapters only
        assert len(with_state) == 8 and all(".lora_" in n for n in with_state), with_state


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_generate_equals_unsharded_on_every_rank(pools, kind):
    for same, signature, doc in pools(2).run(generate_pair, kind):
        assert same == {"greedy": True, "sampled": True, "beams": True}
        assert signature and doc


@pytest.mark.parametrize(
    "kind, dtype, max_shard_bytes, placement",
    [("gpt2", None, 20_000, None), ("bert", None, 20_000, None), ("llama_tied", torch.bfloat16, 2**30, None),
     ("llama_lora", None, 20_000, None), ("llama", None, 20_000, shardwise.placement.matrices)],
)
def test_save_pretrained_round_trip_is_bitwise(pools, tmp_path, kind, dtype, max_shard_bytes, placement):
    # (the last: every matrix of the decoder layers owned whole by one rank, for Muon)
    names, checks = pools(2).run(export_round_trip, kind, str(tmp_path), dtype, max_shard_bytes, placement)[0]
    assert all(checks.values()), checks
    assert "config.json" in names and ("generation_config.json" in names) == (kind != "bert")
    if max_shard_bytes < 2**30:
        assert "model.safetensors.index.json" in names and "model-00002-of-" in " ".join(names)
    else:
        assert "model.safetensors" in names
    adapter = {"adapter_config.json", "adapter_model.safetensors"}
    assert adapter <= set(names) if kind == "llama_lora" else not adapter & set(names)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_from_pretrained_directory_loads_into_a_meta_model(pools, tmp_path, kind):
    same, buffers_ok, warned = pools(2).run(load_pretrained_dir, kind, str(tmp_path), False)[0]
    assert same and buffers_ok and warned == []


def test_names_are_mapped_as_transformers_does(pools, tmp_path):
    # a LlamaModel checkpoint (no "model." prefix) into LlamaForCausalLM: with a tied head
    # every tensor is found; without, the head is missing and keeps its values, with a warning
    tied, untied = str(tmp_path / "tied"), str(tmp_path / "untied")
    same, buffers_ok, warned = pools(2).run(load_pretrained_dir, "llama_tied", tied, True)[0]
    assert same and buffers_ok and warned == []
    same, buffers_ok, warned = pools(2).run(load_pretrained_dir, "llama", untied, True)[0]
    assert not same and buffers_ok and len(warned) == 1 and "'lm_head.weight'" in warned[0]


def test_gathered_as_a_decorator_keeps_the_signature():
    def step(x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        """One step."""
        return x * scale

    wrapped = shardwise.gathered(nn.Linear(2, 2))(step)  # entered only when called
    assert inspect.signature(wrapped) == inspect.signature(step) and wrapped.__doc__ == step.__doc__


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)


def test_auto_policy_on_other_models():
    assert repr(shardwise.wrap.auto(TiedTransformer())) == "by_class(Block)"
    assert repr(shardwise.wrap.auto(PrimeMLP())) == "by_class(Layer)"
    assert repr(shardwise.wrap.auto(Plain())) == "by_size(18)"  # 1/8 of 144 parameters


def test_core_imports_no_optional_library():
    # (tqdm is left out: torch imports it itself when it is installed)
    optional = ("transformers", "peft", "matplotlib", "lightning", "accelerate")
    code = f"import sys, shardwise; print([m for m in sys.modules if m.split('.')[0] in {optional}])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
