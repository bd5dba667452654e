"""Fault tolerance across replica groups on torchft (shardwise.ft): real torchrun jobs of 2 ranks,
one per group, on a lighthouse in this process (tests/ft_job.py is one rank).

- A group killed mid-step (SIGKILL of one rank in the middle of its backward) is dropped while
  the other goes on; torchrun restarts it and it heals from the live group, rank for rank. No
  committed step is repeated or skipped, both groups end bitwise equal, and equal, bitwise, to
  a replay of the same participation record without any failure (outer_groups.replay, in the
  pool of 4 ranks standing for the two jobs).
- A group that joins late heals fp16's loss scale, int8's error feedback residuals and owned
  parameters' state, and hybrid sharding inside a job; the groups end bitwise equal.
- Clear ends: an unreachable lighthouse at start, a group whose layout differs (CannotHeal,
  while the live group goes on), and a lighthouse lost mid-run (LighthouseLost on every rank).

Skips, naming the extra, where torchft is not installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="fault tolerance needs torchft: pip install -e '.[ft]'")

import torch  # noqa: E402
from outer_groups import replay  # noqa: E402

HERE = Path(__file__).resolve().parent


@pytest.fixture
def lighthouse():
    """torchft's lighthouse in this process, on a free port; its address for the jobs."""
    from shardwise.ft.lighthouse import serve

    server = serve(port=0, bind="127.0.0.1")
    port = int(re.search(r":(\d+)$", server.address()).group(1))
    holder = {"server": server, "address": f"http://127.0.0.1:{port}"}
    yield holder
    if holder["server"] is not None:
        holder["server"].shutdown()


class Jobs:
    """torchrun jobs of this test, each in a session of its own: all are killed at the end."""

    def __init__(self, out: Path, lighthouse: str):
        self.out, self.lighthouse, self.procs = out, lighthouse, []

    def start(self, group: int, nproc: int = 2, restarts: int = 1, **cfg) -> subprocess.Popen:
        cfg = {"group": group, "out": str(self.out), **cfg}
        env = {
            **os.environ, "TORCHFT_LIGHTHOUSE": self.lighthouse, "OMP_NUM_THREADS": "1",
            # a restarted job's ranks must not read the store keys of the run before
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "--max-restarts", str(restarts), "--monitor-interval", "0.5", str(HERE / "ft_job.py"), json.dumps(cfg),
        ]
        log = open(self.out / f"g{group}.log", "w")  # noqa: SIM115 (the child holds it)
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def wait(self, proc: subprocess.Popen, timeout: float) -> int:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"a job did not end within {timeout} s:\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.out.glob("g*.log")))

    def close(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.fixture
def jobs(tmp_path, lighthouse):
    j = Jobs(tmp_path, lighthouse["address"])
    yield j
    j.close()


def records(out: Path, group: int) -> dict[str, list]:
    """Each run's record of each rank of ``group``: [step, groups in the quorum, committed, s]."""
    return {
        p.stem: [json.loads(line) for line in p.read_text().splitlines()]
        for p in sorted(out.glob(f"g{group}-r*-run*.jsonl"))
    }


def participation(out: Path, steps: int) -> list[list[int]]:
    """Which groups took part in each committed step: both where a quorum of 2 committed it,
    else the one group that committed it alone."""
    taking_part: list[set[int]] = [set() for _ in range(steps)]
    for group in (0, 1):
        for rec in records(out, group).values():
            for step, groups, committed, _ in rec:
                if committed and step < steps:
                    taking_part[step] |= {0, 1} if groups == 2 else {group}
    assert all(taking_part), f"steps no group committed: {[s for s, t in enumerate(taking_part) if not t]}"
    return [sorted(t) for t in taking_part]


def check_steps(rec: list) -> None:
    """A run's committed steps follow each other; a step that failed is tried again."""
    committed = [step for step, _, done, _ in rec if done]
    assert committed == list(range(committed[0], committed[0] + len(committed))), committed
    for (step, _, done, _), (after, *_) in zip(rec, rec[1:]):
        assert after == (step + 1 if done else step), rec


def final(out: Path, group: int, rank: int) -> dict:
    return torch.load(out / f"g{group}-{rank}.pt", weights_only=False)


def test_a_lost_group_heals_and_training_equals_its_participation_record(jobs, pools):
    a = jobs.start(0, steps=10, pause=0.2)
    b = jobs.start(1, steps=10, pause=0.2, kill=[4, 1])  # rank 1 of group 1 dies mid-backward
    assert [jobs.wait(a, 240), jobs.wait(b, 240)] == [0, 0], jobs.logs()
    out = jobs.out
    runs = {**records(out, 0), **records(out, 1)}
    for rec in runs.values():
        check_steps(rec)
    assert "g1-r0-run1" in runs, "group 1 was not restarted"
    steps = runs["g0-r0-run0"][-1][0] + 1
    record = participation(out, steps)
    lost = [s for s, t in enumerate(record) if t == [0]]
    assert lost, f"group 0 never trained alone: {record}"
    healed_at = runs["g1-r0-run1"][0][0]
    assert healed_at > lost[-1] and record[healed_at] == [0, 1]
    references = pools(4).run(replay, record, steps)
    for rank in (0, 1):
        mine, twin = final(out, 0, rank), final(out, 1, rank)
        assert twin["heal"][0] == healed_at and twin["heal"][1] > 0  # its shards, from memory
        for name, value in mine["state"].items():
            assert torch.equal(value, twin["state"][name]), f"rank {rank}: the groups differ in {name}"
        ref = references[rank]  # pool rank r is rank r of group 0
        different = [n for n, v in mine["state"].items() if not torch.equal(v, ref[n])]
        assert not different, f"rank {rank}: differs from the replayed record in {different}"


@pytest.mark.parametrize(
    "variant",
    [
        {"mixed_precision": "fp16", "comm": "int8", "error_feedback": True, "owned": True},
        {"strategy": "hybrid_shard", "comm": "int8", "error_feedback": True},
    ],
    ids=["fp16-int8-owned", "hybrid-int8"],
)
def test_a_late_group_heals_every_kind_of_state(jobs, variant):
    a = jobs.start(0, steps=8, pause=0.1, restarts=0, **variant)
    deadline = time.monotonic() + 120
    while not any(r and r[-1][0] >= 2 for r in records(jobs.out, 0).values()):  # group 0 trained a while
        assert time.monotonic() < deadline and a.poll() is None, jobs.logs()
        time.sleep(0.2)
    b = jobs.start(1, steps=8, pause=0.1, restarts=0, **variant)
    assert [jobs.wait(a, 180), jobs.wait(b, 180)] == [0, 0], jobs.logs()
    for rank in (0, 1):
        mine, twin = final(jobs.out, 0, rank), final(jobs.out, 1, rank)
        assert twin["heal"] is not None and twin["heal"][0] >= 3
        assert mine["residuals"] and mine["residuals"].keys() == twin["residuals"].keys()
        for name, value in [*mine["state"].items(), *mine["residuals"].items()]:
            other = twin["state"].get(name, twin["residuals"].get(name))
            assert torch.equal(value, other), f"rank {rank}: the groups differ in {name}"
        assert mine["scale"] == twin["scale"]


def start_without_lighthouse(address: str):
    import shardwise
    import shardwise.ft
    from nets import make

    ft = shardwise.ft.Torchft(lighthouse=address, replica_id="g0", timeout=2)
    t0 = time.monotonic()
    try:
        shardwise.shard(make("tied"), fault_tolerance=ft)
    except shardwise.ft.LighthouseUnreachable as e:
        return str(e), time.monotonic() - t0
    return "no error", 0.0


def test_an_unreachable_lighthouse_is_named_at_start(pools):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"http://127.0.0.1:{s.getsockname()[1]}"
    for message, seconds in pools(2).run(start_without_lighthouse, address):
        assert address in message and seconds < 10, message


def test_a_group_that_cannot_heal_ends_and_a_lost_lighthouse_ends_every_rank(jobs, lighthouse):
    a = jobs.start(0, steps=10_000, pause=0.1, restarts=0, timeout=5, max_steps=100_000)
    deadline = time.monotonic() + 120
    while not any(r and r[-1][0] >= 2 for r in records(jobs.out, 0).values()):
        assert time.monotonic() < deadline and a.poll() is None, jobs.logs()
        time.sleep(0.2)
    b = jobs.start(1, nproc=1, steps=10, restarts=0, timeout=5)  # one rank: not the layout of group 0
    assert jobs.wait(b, 120) != 0
    message = (jobs.out / "g1-error-0.txt").read_text()
    assert message.startswith("CannotHeal") and "'ranks'" in message and "this group 1" in message, message
    # group 0 goes on alone once group 1 is gone
    seen = max(r[-1][0] for r in records(jobs.out, 0).values())
    while min(r[-1][0] for r in records(jobs.out, 0).values()) < seen + 3:
        assert time.monotonic() < deadline and a.poll() is None, jobs.logs()
        time.sleep(0.2)
    lighthouse["server"].shutdown()
    lighthouse["server"] = None
    lost = time.time()
    assert jobs.wait(a, 60) != 0
    for rank in (0, 1):
        ended = jobs.out / f"g0-error-{rank}.txt"
        message = ended.read_text()
        assert message.startswith("LighthouseLost") and jobs.lighthouse in message, message
        assert ended.stat().st_mtime - lost < 8, "the ranks did not end within seconds"
