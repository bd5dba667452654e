"""A tiny LightningModule and what the Lightning tests run on every rank of a pool: the same
module trained by ``Trainer(strategy="ddp")`` and ``strategy="shardwise"`` (fit, save, resume
in a new Trainer, validate, test, predict), and the options that must be refused at setup.

Lightning keeps some state in the process (environment variables, the rank it prints from);
each task puts ``os.environ`` back as it found it, since the pool's workers live on."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from pool import framework_task
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise.core.runtime import runtime_of
from shardwise.job.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=2, mlp_ratio=2)
SAMPLES = 64  # 2 ranks x 2 sequences x 2 micro-batches x 8 steps
CLIP_FP16 = 1.0  # clipping after the scaler's unscale_


def _lightning():
    import lightning as L

    import shardwise.lightning  # noqa: F401

    return L


def make_module(seed: int = 0, lr: float = 0.05, **kwargs):
    """A LightningModule around a tiny GPT (defined here so that workers can import it)."""
    L = _lightning()

    class LitGPT(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            self.gpt = GPT(CFG)
            self.example_input_array = torch.zeros(2, CFG.seq_len, dtype=torch.long)
            self.grad_norm, self.first_loss = 0.0, None

        def forward(self, x):
            return self.gpt(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = self.gpt(x, y)
            self.log("train_loss", loss, sync_dist=True)
            if self.first_loss is None:
                self.first_loss = loss.item()
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", self.gpt(x, y), sync_dist=True)

        def test_step(self, batch, batch_idx):
            x, y = batch
            self.log("test_loss", self.gpt(x, y), sync_dist=True)

        def predict_step(self, batch, batch_idx):
            return self.gpt(batch[0]).argmax(-1)

        def on_before_optimizer_step(self, optimizer):  # before clipping; whole gradients under ddp
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.grad_norm = max(self.grad_norm, torch.nn.utils.get_total_norm(grads).item())

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.1)
            schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    return LitGPT()


def loader(n: int = SAMPLES, seed: int = 1) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CFG.vocab_size, (n, CFG.seq_len + 1), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)


def trainer(strategy, devices: int, **kwargs):
    """A quiet Trainer on ``devices`` CPU ranks; ``strategy`` a name or ShardwiseStrategy's
    options (a dict: a fresh strategy per Trainer)."""
    L = _lightning()
    if isinstance(strategy, dict):
        from shardwise.lightning import ShardwiseStrategy

        strategy = ShardwiseStrategy(**strategy)
    defaults = dict(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )
    return L.Trainer(strategy=strategy, devices=devices, **{**defaults, **kwargs})


def _full_state(module, sharded: bool) -> dict[str, torch.Tensor]:
    if sharded:
        return shardwise.full_state_dict(module, rank0_only=False)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _strategy(name: str, options: dict | None):
    return options if name == "shardwise" and options else name


def fit_save_resume(tmp: str, resume_here: bool, options: dict | None = None, **trainer_kwargs) -> dict:
    """``ddp`` and ``shardwise`` (with ``ShardwiseStrategy(**options)`` if given) each fit 4
    steps and save; with ``resume_here``, each then resumes in a new Trainer and a module of
    other initial values to step 8, validates, tests and predicts (else another pool does)."""
    world = dist.get_world_size()
    out: dict = {}
    with framework_task():
        for name in ("ddp", "shardwise"):
            module = make_module()
            t = trainer(_strategy(name, options), world, max_steps=4, **trainer_kwargs)
            t.fit(module, loader())
            t.save_checkpoint(f"{tmp}/{name}.ckpt")
            out[f"{name}/4"] = _full_state(module, name == "shardwise")
            out[f"{name}/grad_norm"] = module.grad_norm
            if name == "shardwise":
                out["shardwise/units"] = [u.label for u in shardwise.units(module)]
                out["shardwise/files"] = sorted(os.listdir(f"{tmp}/{name}.ckpt"))
            if resume_here:
                out.update(resume(tmp, name, options, **trainer_kwargs))
    return out


def resume(tmp: str, name: str, options: dict | None = None, **trainer_kwargs) -> dict:
    """Resume ``name``'s checkpoint to step 8, in a module of other initial values."""
    world = dist.get_world_size()
    out: dict = {}
    with framework_task():
        module = make_module(seed=7)
        t = trainer(_strategy(name, options), world, max_steps=8, **trainer_kwargs)
        t.fit(module, loader(), ckpt_path=f"{tmp}/{name}.ckpt")
        out[f"{name}/8"] = _full_state(module, name == "shardwise")
        out[f"{name}/lr"] = t.optimizers[0].param_groups[0]["lr"]
        out[f"{name}/validate"] = t.validate(module, loader(8, seed=2), verbose=False)[0]["val_loss"]
        out[f"{name}/test"] = t.test(module, loader(8, seed=3), verbose=False)[0]["test_loss"]
        out[f"{name}/predict"] = torch.cat(t.predict(module, loader(8, seed=4)))
        # the step-4 weights, loaded for validation only (no optimizer)
        out[f"{name}/validate_ckpt"] = t.validate(
            module, loader(8, seed=2), ckpt_path=f"{tmp}/{name}.ckpt", verbose=False
        )[0]["val_loss"]
    return out


def resume_both(tmp: str, **trainer_kwargs) -> dict:
    out = {}
    for name in ("ddp", "shardwise"):
        out.update(resume(tmp, name, **trainer_kwargs))
    return out


def precision_runs(tmp: str) -> dict:
    """The same fit with precision="32-true", "bf16-mixed", and ShardwiseStrategy's own
    mixed_precision="bf16": the runtime's precision, the first loss and the parameters."""
    out = {}
    from shardwise.lightning import ShardwisePrecision

    runs = {"32-true": ("shardwise", "32-true"), "bf16-mixed": ("shardwise", "bf16-mixed"),
            "option": ({"mixed_precision": "bf16"}, "32-true"),
            # (on CPU Lightning turns precision="16-mixed" into bf16; the plugin keeps fp16)
            "16-mixed": ("shardwise", ShardwisePrecision("16-mixed"))}
    with framework_task():
        for key, (strategy, precision) in runs.items():
            module = make_module()
            flag = {"plugins": [precision]} if isinstance(precision, ShardwisePrecision) else {"precision": precision}
            t = trainer(strategy, dist.get_world_size(), max_steps=3, gradient_clip_val=CLIP_FP16, **flag)
            t.fit(module, loader())
            scaler = t.precision_plugin.scaler
            out[f"{key}/scale"] = scaler.get_scale() if scaler is not None else None
            out[key] = _full_state(module, True)
            out[f"{key}/policy"] = runtime_of(module).precision
            out[f"{key}/first_loss"] = module.first_loss
    return out


def refused_at_setup(kind: str) -> str:
    """What fit() raises for an option ShardwiseStrategy cannot honour."""
    from shardwise.lightning import ShardwiseStrategy

    with framework_task():
        module = make_module()
        if kind == "sync_batchnorm":
            t = trainer("shardwise", dist.get_world_size(), max_steps=1, sync_batchnorm=True)
        elif kind == "memory_budget":
            module.example_input_array = None
            t = trainer(ShardwiseStrategy(memory_budget="1GiB"), dist.get_world_size(), max_steps=1)
        elif kind == "not_a_checkpoint":
            path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"plain-{os.getpid()}.ckpt")
            torch.save({"state_dict": {}}, path)
            t = trainer("shardwise", dist.get_world_size(), max_steps=1)
            try:
                t.fit(module, loader(), ckpt_path=path)
            except Exception as e:
                return f"{type(e).__name__}: {e}"
            finally:
                os.remove(path)
            return "nothing raised"
        else:
            raise ValueError(kind)
        try:
            t.fit(module, loader())
        except Exception as e:
            return f"{type(e).__name__}: {e}"
    return "nothing raised"



def budget_run(budget: str) -> tuple[list[str], str]:
    """ShardwiseStrategy(memory_budget=...): which kind of unit the plan made of each."""
    with framework_task():
        module = make_module()
        t = trainer({"memory_budget": budget}, dist.get_world_size(), max_steps=1)
        t.fit(module, loader())
        rt = runtime_of(module)
        return [f"{u.label}: {type(u).__name__}" for u in rt.units], rt.sharding.value
