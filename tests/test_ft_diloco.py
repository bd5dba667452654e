"""DiLoCo across replica groups (shardwise.ft.Torchft.diloco): two real torchrun jobs of 2
ranks each (full_shard inside each), on a lighthouse in this process, each reading its own
batches, take 3 rounds of 3 inner AdamW steps with fp32 pseudo-gradients. Both jobs end with
the same parameters, within 1e-5 of one process that runs each group's inner steps on an
unsharded copy of the model and the same outer Nesterov step on the groups' averaged
pseudo-gradient (shard index r of each job exchanges only its shard). This file's main is
one rank of a job.

Skips, naming the extra, where torchft is not installed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("RUST_LOG", "warn")
pytest.importorskip("torchft", reason="fault tolerance needs torchft: pip install -e '.[ft]'")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_ft import jobs, lighthouse  # noqa: F401 (fixtures)

H, ROUNDS, LR, OUTER = 3, 3, 1e-2, {"lr": 0.7, "momentum": 0.9, "nesterov": True}


def test_diloco_of_two_sharded_jobs_equals_one_process_of_the_same_rounds(jobs, lighthouse):  # noqa: F811
    jobs.lighthouse = lighthouse
    procs = [jobs.start(g, restarts=0, script=__file__, steps=H * ROUNDS) for g in (0, 1)]
    assert [jobs.wait(p, 240) for p in procs] == [0, 0], jobs.logs()
    got = [torch.load(jobs.out / f"g{g}-full.pt") for g in (0, 1)]
    ref, moved = reference()
    assert moved > 0.05, moved  # (training moved the parameters)
    for g in (0, 1):
        assert got[g]["step"] == H * ROUNDS
        assert ref.keys() <= got[g]["params"].keys()  # (and the tied head.weight)
        diff = max((got[g]["params"][n] - ref[n]).abs().max().item() for n in ref)
        assert diff <= 1e-5, f"group {g} differs from one process by {diff}"
    for n in ref:  # (the groups hold the same global parameters)
        assert torch.allclose(got[0]["params"][n], got[1]["params"][n], rtol=0, atol=1e-6), n


def reference() -> tuple[dict, float]:
    """One process: each group's inner steps on its own copy (with its own AdamW state),
    then Nesterov SGD on the global parameters with the groups' mean pseudo-gradient."""
    from nets import loss_of, make
    from outer_groups import group_batch

    global_model = make("tied")
    start = {n: p.detach().clone() for n, p in global_model.named_parameters()}
    outer = torch.optim.SGD(global_model.parameters(), **OUTER)
    copies = [make("tied") for _ in (0, 1)]
    inner = [torch.optim.AdamW(c.parameters(), lr=LR) for c in copies]
    for r in range(ROUNDS):
        for g, (model, opt) in enumerate(zip(copies, inner, strict=True)):
            model.load_state_dict(global_model.state_dict())
            for step in range(r * H, (r + 1) * H):
                x, y = group_batch("tied", step, g, 2, 2)
                loss_of(model, x, y).backward()
                opt.step()
                opt.zero_grad()
        for name, p in global_model.named_parameters():
            locals_ = [dict(c.named_parameters())[name].detach() for c in copies]
            p.grad = sum(p.detach() - q for q in locals_) / len(locals_)
        outer.step()
        outer.zero_grad()
    params = {n: p.detach().clone() for n, p in global_model.named_parameters()}
    return params, max((params[n] - start[n]).abs().max().item() for n in params)


def main(cfg: dict) -> None:
    """One rank of job ``cfg['group']``: DiLoCo with the test's rounds, then its full
    parameters (rank 0) in ``out/g<group>-full.pt``."""
    import torch.distributed as dist
    from outer_groups import build, forward_backward

    import shardwise
    import shardwise.ft

    shardwise.init(timeout=60)
    rank, world = dist.get_rank(), dist.get_world_size()
    ft = shardwise.ft.Torchft(
        lighthouse=os.environ["TORCHFT_LIGHTHOUSE"], replica_id=f"g{cfg['group']}", min_replicas=2, timeout=30,
        max_failed_steps=200,  # (the first quorum waits for the other job to start)
    )
    model, inner = build(ft, lr=LR)
    opt = ft.diloco(inner, sync_every=H, outer_optimizer=lambda ps: torch.optim.SGD(ps, **OUTER))
    while ft.step < cfg["steps"]:
        opt.zero_grad()
        forward_backward(model, "tied", ft.step, cfg["group"], rank, world)
        assert opt.step(), f"a round did not commit: {ft._manager.errored()}"
    full = shardwise.full_state_dict(model)
    if rank == 0:
        torch.save({"params": full, "step": ft.step}, Path(cfg["out"]) / f"g{cfg['group']}-full.pt")
    ft.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
