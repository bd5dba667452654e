"""A job torchrun restarts rendezvouses again without TORCH_DISABLE_SHARE_RDZV_TCP_STORE
(Note [a restarted job's store] in shardwise/core/groups.py): one torchrun job of 2 ranks whose
ranks take turns dying by SIGKILL after the rendezvous, in attempt after attempt; every
restart must make its groups and reduce over them (before the fix, 4 restarts in 5 failed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

RESTARTS = 4


def test_a_restarted_job_rendezvouses_in_the_agents_store_attempt_after_attempt(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "--max-restarts", str(RESTARTS), "--monitor-interval", "0.2", __file__, str(tmp_path),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, start_new_session=True)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    reduced = sorted(p.name for p in tmp_path.glob("attempt*"))
    assert reduced == [f"attempt{a}-rank{r}" for a in range(RESTARTS + 1) for r in (0, 1)], reduced
    assert all(p.read_text() == "3.0" for p in tmp_path.glob("attempt*"))


def attempt(out: Path) -> None:
    """One rank of one attempt: rendezvous, reduce over the world and over a group made after
    it (as shard() makes its groups), record it; on every attempt but the last, one rank
    (they take turns) dies."""
    import torch
    import torch.distributed as dist

    import shardwise

    shardwise.init(timeout=30)
    rank, restart = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t, group=dist.new_group([0, 1]))
    dist.all_reduce(torch.zeros(1))
    (out / f"attempt{restart}-rank{rank}").write_text(str(t.item()))
    if restart < RESTARTS and rank == restart % 2:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()


if __name__ == "__main__":
    attempt(Path(sys.argv[1]))
