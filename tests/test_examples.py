"""examples/finetune_hf.py under torchrun at N=2: LoRA on a transformers checkpoint that each
rank reads row by row into a meta-built model, trained, exported and reloaded by
from_pretrained (the example itself checks that the reloaded model gives the sharded loss)."""

import os
import subprocess
import sys
from pathlib import Path

import safetensors.torch
import torch
from transformers import LlamaConfig, LlamaForCausalLM

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "finetune_hf.py"


def test_finetune_hf_example_with_lora(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "base")  # untied head, one file
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(EXAMPLE), "--lora", "--init-from", str(tmp_path / "base"), "--out", str(out),
         "--steps", "6", "--seq-len", "32", "--batch-size", "2"],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "PeftModel, units by_class(LlamaDecoderLayer)" in run.stdout
    assert "reloaded with from_pretrained" in run.stdout, run.stdout
    assert "has no values for" not in run.stderr  # every base weight came from the checkpoint
    names = sorted(p.name for p in out.iterdir())
    assert names == ["adapter_config.json", "adapter_model.safetensors", "config.json",
                     "generation_config.json", "model.safetensors"]
    # the frozen base went through load (rows per rank), training and export unchanged
    base = safetensors.torch.load_file(tmp_path / "base" / "model.safetensors")
    exported = safetensors.torch.load_file(out / "model.safetensors")
    assert exported.keys() == base.keys()
    assert all(torch.equal(exported[k], v) for k, v in base.items())
    adapter = safetensors.torch.load_file(out / "adapter_model.safetensors")
    assert len(adapter) == 8 and any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)
