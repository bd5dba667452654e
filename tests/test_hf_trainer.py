"""transformers' Trainer with shardwise (shardwise.hf.Trainer): a tiny Llama trained with
gradient accumulation, clipping and a schedule equals transformers' own DDP run of the same
script within 1e-5 (losses, gradient norms and weights); a checkpoint resumed by a new Trainer
equals the run that never stopped, at the same world size, and the DDP run resumed at another
one; save_model writes a directory from_pretrained loads bit for bit; settings it cannot
honour raise when the Trainer is built; the example runs under torchrun. Pools of Gloo
workers run the Trainers in-process (hf_trainer_runs.py holds the tasks)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs the [hf] extra: pip install -e '.[hf]'")
pytest.importorskip("accelerate", reason="needs the [hf] extra: pip install -e '.[hf]'")

from hf_trainer_runs import best_model, refused, resume, train_and_export

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "hf_trainer.py"


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _assert_close(a: dict, b: dict, rel: float = 1e-5) -> None:
    scale = max(v.abs().max().item() for v in a.values())
    assert _max_diff(a, b) <= rel * scale, (_max_diff(a, b), scale)


def test_equals_ddp_resumes_at_any_world_size_and_exports(pools, tmp_path):
    out = pools(2).run(train_and_export, str(tmp_path))[0]
    assert out["accelerator"] == "ShardwiseAccelerator"
    for (loss, norm), (ref_loss, ref_norm) in zip(out["shardwise/log"], out["ddp/log"], strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5)
    assert min(norm for _, norm in out["ddp/log"]) > 10 * 0.1  # max_grad_norm=0.1 clipped every step
    _assert_close(out["ddp/final"], out["shardwise/final"])
    assert {"shardwise", "model.safetensors", "config.json", "scheduler.pt", "trainer_state.json"} <= set(out["checkpoint"])
    assert "optimizer.pt" not in out["checkpoint"]  # the optimizer's state is in shardwise/, sharded
    assert all((out["exported"][k] == v).all() for k, v in out["shardwise/final"].items())

    again = pools(2).run(resume, str(tmp_path))[0]  # checkpoint-2, into a model of other values
    assert _max_diff(again["shardwise/resumed"], out["shardwise/final"]) == 0  # as if never stopped
    _assert_close(again["ddp/resumed"], again["shardwise/resumed"])
    assert again["shardwise/lr"] == again["ddp/lr"]

    other = pools(1).run(resume, str(tmp_path))[0]  # saved by 2 processes, resumed by 1
    _assert_close(other["ddp/resumed"], other["shardwise/resumed"])
    assert _max_diff(other["shardwise/resumed"], out["shardwise/final"]) > 0  # another data split


def test_load_best_model_at_end(pools, tmp_path):
    assert pools(2).run(best_model, str(tmp_path))[0] == ("checkpoint-2", 0.0)


@pytest.mark.parametrize(
    "kind, message",
    [("fp16", "TrainingArguments(fp16=...) is not supported"),
     ("checkpointing", "ShardOptions(activation_checkpointing=")],
)
def test_refused_when_built(pools, tmp_path, kind, message):
    raised = pools(2).run(refused, str(tmp_path), kind)[0]
    assert raised.startswith("ShardwiseError") and message in raised, raised


def test_example_under_torchrun(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(EXAMPLE), "--out", str(tmp_path), "--steps", "6", "--save-steps", "3",
         "--seq-len", "32", "--batch-size", "2"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "2 processes, step 6" in run.stdout and "reloaded with from_pretrained" in run.stdout
    assert (tmp_path / "checkpoint-6" / "shardwise" / "COMMITTED").is_file()
    assert (tmp_path / "final" / "model.safetensors").is_file()
