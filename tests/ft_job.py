"""One rank of a replica group in the fault-tolerance tests (test_ft.py): torchrun starts a job
per group; its ranks train with shardwise.ft on the lighthouse at $TORCHFT_LIGHTHOUSE. Each
step appends (committed step, groups in its quorum, committed or not, seconds) to
``out/g<group>-r<rank>-run<restart>.jsonl`` as it goes (a killed run keeps its record); at
the end each rank writes its shards, optimizer state, committed step and what it healed to
``out/g<group>-<rank>.pt``.

The job is given as JSON: ``group`` (its index: job ``g`` reads its own batches), ``steps``,
``pause`` (seconds a step, so that groups overlap), ``strategy`` and shard() options, and
``kill``: ``[step, rank]`` to SIGKILL that rank in the middle of the backward of the first
step from ``step`` on that both groups take part in, on the job's first run only. A job saves
its state and stops (goes on, with ``forever``) at the first committed step from ``steps`` on
that follows ``tail`` steps both groups took part in: the same step on both (they see the
same quorums), and only once a killed group is back. Also fp16's ``init_scale``,
``slow_send`` (seconds each snapshot a heal fetches is served late) and ``poison`` (a rank
whose all-reduce across groups failed makes a gradient infinite, as the failure may leave it).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plain_groups import build, forward_backward, options_of, rank_state, residuals, scaler_of

import shardwise
import shardwise.ft
from shardwise.ft.transport import Transport


def main(cfg: dict) -> None:
    try:
        train(cfg)
    except shardwise.ft.FaultToleranceError as e:  # the test reads every rank's end
        Path(cfg["out"], f"g{cfg['group']}-error-{dist.get_rank()}.txt").write_text(f"{type(e).__name__}: {e}")
        raise


def train(cfg: dict) -> None:
    shardwise.init(timeout=60)
    rank, world = dist.get_rank(), dist.get_world_size()
    first_run = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    ft = shardwise.ft.Torchft(
        lighthouse=os.environ["TORCHFT_LIGHTHOUSE"], replica_id=f"g{cfg['group']}", timeout=cfg.get("timeout", 20),
        quorum_timeout=cfg.get("quorum_timeout", 30),
    )
    if cfg.get("slow_send"):
        serve_late(cfg["slow_send"])
    model, inner = build(ft, **options_of(cfg))
    scaler = scaler_of(model, cfg)
    opt = ft.optimizer(inner)
    out = Path(cfg["out"])
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    log = open(out / f"g{cfg['group']}-r{rank}-run{restart}.jsonl", "w")  # noqa: SIM115
    together, saved, t0 = 0, False, time.monotonic()
    while not (saved and not cfg.get("forever")):
        if ft.step > cfg.get("max_steps", 400):
            raise RuntimeError(f"group {cfg['group']} never trained beside the other again")
        opt.zero_grad()
        step = ft.step
        kill = cfg.get("kill")
        if first_run and kill and step >= kill[0] and rank == kill[1] and ft.participants == 2:
            model.blocks[1].register_full_backward_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))
        forward_backward(model, "tied", step, cfg["group"], rank, world, scale=scaler)
        if cfg.get("poison") and ft.leads and ft.errored():  # what a failed all-reduce may leave
            next(p.grad for p in model.parameters() if p.grad is not None).fill_(float("inf"))
        if scaler:
            scaler.step(opt)  # steps opt unless a gradient is not finite; opt steps if it commits
            scaler.update()
        else:
            opt.step()
        committed = ft.step > step
        together = together + 1 if committed and ft.participants == 2 else 0 if committed else together
        log.write(json.dumps([step, ft.participants, committed, time.monotonic() - t0]) + "\n")
        log.flush()
        if not saved and ft.step >= cfg["steps"] and together >= cfg.get("tail", 3):
            save(out / f"g{cfg['group']}-{rank}.pt", model, inner, scaler, ft)
            saved = True
        time.sleep(cfg.get("pause", 0.0))
    ft.shutdown()
    dist.destroy_process_group()


def serve_late(seconds: float) -> None:
    """Serve each quorum's snapshot ``seconds`` late, so that a healing rank asks first."""
    send = Transport.send_checkpoint

    def late(self, *args, **kwargs):
        time.sleep(seconds)
        return send(self, *args, **kwargs)

    Transport.send_checkpoint = late


def save(path: Path, model, inner, scaler, ft) -> None:
    heal = ft.last_heal
    torch.save(
        {
            "state": {**rank_state(model, inner), **residuals(model)},
            "heal": None if heal is None else (heal.step, heal.bytes, heal.seconds),
            "scale": scaler.get_scale() if scaler else None,
            "step": ft.step,
        },
        path,
    )


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
