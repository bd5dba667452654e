"""Lightning's Trainer with strategy="shardwise" (shardwise.lightning): the same LightningModule
trained by Lightning's own "ddp" and by "shardwise" (gradient accumulation, clipping by norm,
AdamW with a per-step schedule) is equal within 1e-5 after a fit, after a save and a resume in
a new Trainer (at the same and at another world size), and in validate, test and predict;
"bf16-mixed" is shardwise's bf16 mixed precision; options it cannot honour raise at setup,
naming the option; the example runs under Lightning's own launcher and under torchrun.
Pools of Gloo workers (tests/pool.py) run the Trainers in-process, so that few processes
start; lightning_nets.py holds the module and the tasks."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="needs the [lightning] extra: pip install -e '.[lightning]'")

import lightning as L
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins import TorchCheckpointIO
from lightning_nets import (
    budget_run,
    fit_save_resume,
    precision_runs,
    refused_at_setup,
    resume_both,
)

import shardwise
from shardwise.lightning import ShardwisePrecision, ShardwiseStrategy

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "lightning_gpt.py"
CLIP = 0.05  # well below the gradients' norm (about 1): clipping acts at every step


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _assert_close(a: dict, b: dict, rel: float = 1e-5) -> None:
    scale = max(v.float().abs().max().item() for v in a.values())
    assert _max_diff(a, b) <= rel * scale, (_max_diff(a, b), scale)


def test_equals_ddp_through_fit_save_resume_validate_test_predict(pools, tmp_path):
    # ShardwiseStrategy's options here; resume_at_another_world_size takes strategy="shardwise"
    options = dict(wrap={shardwise.job.models.Block}, activation_checkpointing={shardwise.job.models.Block})
    out = pools(2).run(
        fit_save_resume, str(tmp_path), True, options, accumulate_grad_batches=2, gradient_clip_val=CLIP,
    )[0]
    assert out["ddp/grad_norm"] > 10 * CLIP  # so clipping acted in both runs
    for stage in ("4", "8"):
        _assert_close(out[f"ddp/{stage}"], out[f"shardwise/{stage}"])
    assert out["shardwise/lr"] == out["ddp/lr"] == pytest.approx(0.05 * 0.5**2)  # the schedule resumed
    for stage in ("validate", "test", "validate_ckpt"):
        assert out[f"shardwise/{stage}"] == pytest.approx(out[f"ddp/{stage}"], rel=1e-5)
    assert torch.equal(out["shardwise/predict"], out["ddp/predict"])
    assert out["shardwise/validate_ckpt"] != out["shardwise/validate"]  # step 4's weights, not 8's
    assert out["shardwise/units"] == ["gpt.blocks.0", "gpt.blocks.1", "<root>"]
    assert out["shardwise/files"] == ["COMMITTED", "index.json", "rank-00000-of-00002.safetensors",
                                      "rank-00001-of-00002.safetensors"]


def test_resume_at_another_world_size(pools, tmp_path):
    # saved by 2 ranks, resumed by 1: as Lightning's ddp resumes its own checkpoint there
    # (clipped by value here: element-wise on the shards, so exact)
    clip = dict(accumulate_grad_batches=2, gradient_clip_val=0.002, gradient_clip_algorithm="value")
    pools(2).run(fit_save_resume, str(tmp_path), False, **clip)
    out = pools(1).run(resume_both, str(tmp_path), **clip)[0]
    _assert_close(out["ddp/8"], out["shardwise/8"])
    assert out["shardwise/validate"] == pytest.approx(out["ddp/validate"], rel=1e-5)


def test_precision_flags_are_shardwise_mixed_precision(pools, tmp_path):
    outs = pools(2).run(precision_runs, str(tmp_path))
    out = outs[0]
    assert out["bf16-mixed/policy"] == out["option/policy"] == shardwise.MixedPrecision.of("bf16")
    assert out["32-true/policy"] == shardwise.MixedPrecision()
    assert all(torch.equal(out["bf16-mixed"][k], out["option"][k]) for k in out["option"])
    assert all(v.dtype == torch.float32 for v in out["bf16-mixed"].values())  # fp32 master shards
    assert _max_diff(out["32-true"], out["bf16-mixed"]) > 0  # computed in bf16 indeed
    assert out["bf16-mixed/first_loss"] == pytest.approx(out["32-true/first_loss"], rel=1e-2)
    # "16-mixed": fp16 compute with shardwise.GradScaler, which unscales before clipping
    assert out["16-mixed/policy"] == shardwise.MixedPrecision.of("fp16")
    assert out["32-true/scale"] is None
    scales = [o["16-mixed/scale"] for o in outs]  # every rank took the same skip decisions
    assert scales[0] == scales[1] and 2.0**13 <= scales[0] <= 2.0**16, scales
    assert out["16-mixed/first_loss"] == pytest.approx(out["32-true/first_loss"], rel=1e-2)
    assert all(v.isfinite().all() for v in out["16-mixed"].values())


def test_memory_budget_plans_the_modules_forward(pools):
    # planned on fake tensors with the module's example_input_array: roomy, DDP's layout is
    # fastest; tight, the blocks are sharded
    roomy, tight = (pools(2).run(budget_run, budget)[0] for budget in ("64MiB", "400KiB"))
    assert roomy == (["<root>: ReplicatedUnit"], "no_shard"), roomy
    assert tight[0] == ["gpt.blocks.0: ShardedUnit", "gpt.blocks.1: ShardedUnit", "<root>: ShardedUnit"], tight


@pytest.mark.parametrize(
    "kind, message",
    [
        ("sync_batchnorm", "Trainer(sync_batchnorm=True) is not supported"),
        ("memory_budget", "example_input_array"),
        ("not_a_checkpoint", "is not a checkpoint written by ShardwiseStrategy"),
    ],
)
def test_refused_at_setup(pools, kind, message):
    raised = pools(2).run(refused_at_setup, kind)[0]
    assert raised.startswith("ShardwiseError") and message in raised, raised


def test_registered_and_refused_when_the_trainer_is_built():
    assert isinstance(L.Trainer(strategy="shardwise", accelerator="cpu", devices=2).strategy, ShardwiseStrategy)
    cases = [
        (dict(precision="16-true"), "precision='16-true' is not supported"),
        (dict(precision="64-true"), "precision='64-true' is not supported"),
        (dict(plugins=[TorchCheckpointIO()]), "TorchCheckpointIO"),
        (dict(strategy=ShardwiseStrategy(mixed_precision="fp16"), precision="bf16-mixed"), "disagree"),
        (dict(accelerator=_OtherAccelerator()), "chose _OtherAccelerator"),
    ]
    for kwargs, message in cases:
        with pytest.raises(shardwise.ShardwiseError, match=message):
            L.Trainer(**{"strategy": "shardwise", "accelerator": "cpu", "devices": 2, **kwargs})
    with pytest.raises(shardwise.ShardwiseError, match="strategy='zero3'"):
        ShardwiseStrategy(strategy="zero3")
    assert ShardwisePrecision("bf16-mixed").mixed_precision == "bf16"


class _OtherAccelerator(L.pytorch.accelerators.Accelerator):
    """An accelerator that is neither CPU nor CUDA, as MPS or XLA would be (neither can be
    made on this machine): its devices are CPUs, so only the strategy can tell."""

    def setup_device(self, device):
        pass

    def teardown(self):
        pass

    def get_device_stats(self, device):
        return {}

    @staticmethod
    def parse_devices(devices):
        return CPUAccelerator.parse_devices(devices)

    @staticmethod
    def get_parallel_devices(devices):
        return CPUAccelerator.get_parallel_devices(devices)

    @staticmethod
    def auto_device_count():
        return 1

    @staticmethod
    def is_available():
        return True

    @staticmethod
    def name():
        return "other"


def test_example_under_lightning_launcher_then_torchrun(tmp_path):
    """Lightning's launcher starts the second rank by running the script again; torchrun
    starts both. The second run resumes the first's last checkpoint."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = [str(EXAMPLE), "--devices", "2", "--ckpt-dir", str(tmp_path), "--batch-size", "2"]
    first = subprocess.run(
        [sys.executable, *common, "--steps", "10"], capture_output=True, text=True, timeout=300, env=env,
    )
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    assert "2 ranks, step 10" in first.stdout
    assert (tmp_path / "last.ckpt" / "COMMITTED").is_file()
    second = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         *common, "--steps", "12", "--resume"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert "Restored all states" in second.stdout + second.stderr
    assert "2 ranks, step 12" in second.stdout
