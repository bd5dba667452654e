"""Fault tolerance across replica groups on torchft (shardwise.ft): real torchrun jobs of 2 ranks,
one per group, on a lighthouse in this process (tests/ft_job.py is one rank).

- A group killed mid-step (SIGKILL of one rank in the middle of its backward) is dropped while
  the other goes on; torchrun restarts it and it heals from the live group, rank for rank. No
  committed step is repeated or skipped, both groups end bitwise equal, and equal, bitwise, to
  a replay of the same participation record without any failure (plain_groups.replay, in the
  pool of 4 ranks standing for the two jobs).
  The state includes fp16's loss scale, int8's error feedback residuals and owned matrices;
  also where the failure leaves a gradient not finite, so that the scaler skips the step
  before the vote. Heals in a first step that overflows again and again take that attempt's
  snapshot, served late, and end equal to the replay too.
- Jobs of different sizes (1 rank and 2, hybrid sharding within a "node" of one rank): the
  larger joins late and heals (its second replica through its first); both end bitwise equal and like one process trained on the
  batches of every rank taking part; a job of other shards cannot heal (CannotHeal) while the
  others go on; a lighthouse lost mid-run ends every rank of every group with LighthouseLost
  within seconds.
- An unreachable lighthouse at start is named on every rank.
- A hybrid job's other replicas take what its first replica's manager decided through counted
  broadcasts that the step check compares (a pool of 4 standing for one job), and a first
  replica that dies before it tells ends its follower with a named CollectiveError.

Skips, naming the extra, where torchft is not installed.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers (here and in the jobs) log every quorum
pytest.importorskip("torchft", reason="fault tolerance needs torchft: pip install -e '.[ft]'")

import torch
from plain_groups import replay

from shardwise.core.addresses import free_port

HERE = Path(__file__).resolve().parent


@contextlib.contextmanager
def serving(min_replicas: int = 1):
    """torchft's lighthouse in this process, on a free port, whose quorums need
    ``min_replicas`` groups: its address for the jobs."""
    from shardwise.ft.lighthouse import serve

    server = serve(port=0, bind="127.0.0.1", min_replicas=min_replicas)
    port = re.search(r":(\d+)$", server.address()).group(1)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()


@pytest.fixture
def lighthouse():
    with serving() as address:
        yield address


@pytest.fixture
def lighthouse_process(tmp_path):
    """``shardwise lighthouse`` in a process of its own (killed to lose it): its process and address."""
    from shardwise.ft.lighthouse import reachable

    port = free_port()
    log = open(tmp_path / "lighthouse.log", "w")  # noqa: SIM115 (the child holds it)
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardwise", "lighthouse", "--port", str(port), "--bind", "127.0.0.1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    address = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not reachable(address):
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "lighthouse.log").read_text()
        time.sleep(0.1)
    yield proc, address
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class Jobs:
    """torchrun jobs of this test, each in a session of its own: all are killed at the end."""

    def __init__(self, out: Path):
        self.out, self.lighthouse, self.procs = out, "", []

    def start(self, group: int, nproc: int = 2, restarts: int = 1, script: str | None = None, **cfg) -> subprocess.Popen:
        """Job ``group`` of ``nproc`` ranks running ``script`` (default ft_job.py) with ``cfg``."""
        cfg = {"group": group, "out": str(self.out), **cfg}
        env = {**os.environ, "TORCHFT_LIGHTHOUSE": self.lighthouse, "OMP_NUM_THREADS": "1"}
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "--max-restarts", str(restarts), "--monitor-interval", "0.5", script or str(HERE / "ft_job.py"), json.dumps(cfg),
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
def jobs(tmp_path):
    j = Jobs(tmp_path)
    yield j
    j.close()


def records(out: Path, group: int) -> dict[str, list]:
    """Each run's record of each rank of ``group``: [step, groups in the quorum, committed, s]."""
    found = {p.stem: [json.loads(line) for line in p.read_text().splitlines()] for p in out.glob(f"g{group}-r*-run*.jsonl")}
    return {name: rec for name, rec in sorted(found.items()) if rec}  # (a run killed in its first step has none)


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
    for (step, _, done, _), (after, *_) in itertools.pairwise(rec):
        assert after == (step + 1 if done else step), rec


def final(out: Path, group: int, rank: int) -> dict:
    return torch.load(out / f"g{group}-{rank}.pt", weights_only=False)


def model_state(saved: dict) -> dict:
    """Shards and optimizer state, without the error feedback residuals."""
    return {k: v for k, v in saved["state"].items() if not k.startswith("residual.")}


KILLED = json.loads(os.environ.get("FT_VARIANT", "null")) or {"mixed_precision": "fp16", "comm": "int8", "error_feedback": True, "owned": True}


@pytest.mark.parametrize("failure_left", ["finite gradients", "a gradient not finite"])
def test_a_lost_group_heals_and_training_equals_its_participation_record(jobs, lighthouse, pools, failure_left):
    # fp16 with its loss scale, int8 with error feedback residuals and owned matrices: every
    # kind of state a rank holds is rolled back after the failed step and healed. Where the
    # failed all-reduce across groups leaves a gradient not finite, the scaler skips the step
    # before the vote, and it must be undone all the same (Note [a step the groups did not
    # vote on] in shardwise/ft/steps.py)
    cfg = {**KILLED, "poison": failure_left == "a gradient not finite"}
    jobs.lighthouse = lighthouse
    # group 1 starts first: about one run in two, its first step fails alone (fp16's first
    # scale overflows) and group 0 then joins the first quorum, where torchft's init_sync heals
    # rank 0 and rank 1 of the groups from different primaries (Note [the first quorum heals
    # rank by rank] in shardwise/ft/steps.py); the other runs have group 0 train alone first
    b = jobs.start(1, steps=10, pause=0.2, kill=[4, 1], **cfg)  # rank 1 of group 1 dies mid-backward
    a = jobs.start(0, steps=10, pause=0.2, **cfg)
    assert [jobs.wait(a, 240), jobs.wait(b, 240)] == [0, 0], jobs.logs()
    out = jobs.out
    runs = {**records(out, 0), **records(out, 1)}
    for rec in runs.values():
        check_steps(rec)
    assert "g1-r0-run1" in runs, "group 1 was not restarted"
    steps = max(step for step, _, done, _ in runs["g0-r0-run0"] if done) + 1
    record = participation(out, steps)
    alone = [s for s, t in enumerate(record) if t == [0]]
    assert alone, f"group 0 never trained alone: {record}"
    healed_at = runs["g1-r0-run1"][0][0]
    assert healed_at > alone[-1] and record[healed_at] == [0, 1]
    for rank in (0, 1):
        twin = final(out, 1, rank)
        assert twin["heal"][0] == healed_at and twin["heal"][1] > 0  # its shards, from memory
    equal_to_the_replay(out, runs, record, steps, cfg, pools)


def test_a_heal_in_a_step_taken_again_takes_that_attempts_state(jobs, pools):
    # fp16 from a scale that overflows at step 0 again and again, both groups in every quorum
    # (the lighthouse's): each attempt's quorum heals rank by rank (Note [the first quorum
    # heals rank by rank]), and each snapshot is served late, so that a healing rank that could
    # fetch the skipped attempt's snapshot would, and take its loss scale (Note [a step the
    # groups did not vote on]): the groups would then average gradients of two scales
    cfg = {**KILLED, "init_scale": 2.0**24, "slow_send": 0.5}
    with serving(min_replicas=2) as jobs.lighthouse:
        procs = [jobs.start(g, steps=3, **cfg) for g in (1, 0)]
        assert [jobs.wait(p, 240) for p in procs] == [0, 0], jobs.logs()
    out = jobs.out
    runs = {**records(out, 0), **records(out, 1)}
    skipped = [r for r in runs["g0-r0-run0"] if not r[2]]
    assert len(skipped) >= 3 and all(r[0] == 0 and r[1] == 2 for r in skipped), runs["g0-r0-run0"]
    steps = max(step for step, _, done, _ in runs["g0-r0-run0"] if done) + 1
    equal_to_the_replay(out, runs, participation(out, steps), steps, cfg, pools)


def equal_to_the_replay(out: Path, runs: dict, record: list, steps: int, cfg: dict, pools) -> None:
    """Both groups end with one loss scale and one model and optimizer state, and each rank
    equal, bitwise, to the replay of the participation ``record`` in the pool of 4."""
    joined = {g: sorted({rec[0][0] for name, rec in runs.items() if name.startswith(f"g{g}-")}) for g in (0, 1)}
    references = pools(4).run(replay, record, steps, cfg, joined)
    for rank in (0, 1):
        mine, twin = final(out, 0, rank), final(out, 1, rank)
        assert mine["scale"] == twin["scale"]
        # the model and optimizer state: one for every group (residuals are each group's own)
        differ = [n for n, v in model_state(mine).items() if not torch.equal(v, twin["state"][n])]
        assert not differ, f"rank {rank}: the groups differ in {differ}"
        for group, got in ((0, mine), (1, twin)):
            ref = references[2 * group + rank]  # pool rank 2g + r is rank r of group g
            assert got["state"].keys() == ref.keys()
            assert any(k.startswith("residual.") for k in ref) == bool(cfg.get("error_feedback"))
            differ = [n for n, v in got["state"].items() if not torch.equal(v, ref[n])]
            assert not differ, f"group {group} rank {rank}: differs from the replayed record in {differ}"


def wait_for(jobs: Jobs, what, procs, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            pytest.fail(f"gave up waiting:\n{jobs.logs()}")
        time.sleep(0.2)


def last_steps(out: Path, group: int) -> list[int]:
    return [r[-1][0] for r in records(out, group).values() if r]


def different_sizes(jobs: Jobs, strategy: dict, forever: bool = True) -> dict:
    """A job of 1 rank trains alone; a job of 2 ranks with ``strategy`` (each rank a replica)
    joins late: its first replica heals through torchft and its second from the first (Note
    [jobs of different sizes] in shardwise/ft/replicas.py). All three ranks end bitwise equal
    and, every rank's batch counting once (Note [the job's average before the groups'] in
    shardwise/core/replica_groups.py), like one process on the batches taking part. ``forever``: the jobs go on
    after saving (else they stop and exit). Returns the jobs' config."""
    cfg = {"steps": 4, "pause": 0.1, "restarts": 0, "timeout": 5, "quorum_timeout": 5, "forever": forever,
           "max_steps": 100_000, **strategy}
    a = jobs.start(0, nproc=1, **cfg)
    wait_for(jobs, lambda: min(last_steps(jobs.out, 0), default=0) >= 2, [a])
    b = jobs.start(1, **cfg)
    saved = [jobs.out / f"g{g}-{r}.pt" for g, r in ((0, 0), (1, 0), (1, 1))]
    wait_for(jobs, lambda: all(p.exists() for p in saved), [a, b])
    time.sleep(0.5)  # (written)
    mine = final(jobs.out, 0, 0)
    for rank in (0, 1):
        twin = final(jobs.out, 1, rank)
        assert twin["heal"] is not None and twin["heal"][0] >= 2 and twin["heal"][1] > 0
        differ = [n for n, v in model_state(twin).items() if not torch.equal(v, mine["state"][n])]
        assert not differ, f"rank {rank} of job 1: differs from job 0 in {differ}"
    diff, moved = replay_alone(records(jobs.out, 0)["g0-r0-run0"], mine)
    assert moved > 0.05 and diff <= 1e-5, (diff, moved)
    return cfg


def test_no_shard_jobs_of_different_sizes_heal_and_train_like_one_process(jobs, lighthouse):
    jobs.lighthouse = lighthouse
    different_sizes(jobs, {"strategy": "no_shard"}, forever=False)
    assert [jobs.wait(p, 60) for p in jobs.procs] == [0, 0], jobs.logs()  # (each rank exits cleanly)


def test_jobs_of_different_sizes_heal_and_train_like_one_process_a_wrong_one_cannot_and_a_lost_lighthouse_ends_every_rank(
    jobs, lighthouse_process
):
    server, jobs.lighthouse = lighthouse_process
    # hybrid sharding within a "node" of one rank
    cfg = different_sizes(jobs, {"strategy": "hybrid_shard", "shard_size": 1})
    a, b = jobs.procs
    # a job sharding over 2 ranks: not the others' rows, so it cannot heal; they go on
    c = jobs.start(2, **{**cfg, "shard_size": 2, "forever": False})
    assert jobs.wait(c, 120) != 0
    message = (jobs.out / "g2-error-0.txt").read_text()
    assert message.startswith("CannotHeal") and "1 as ranks, this group 2" in message, message
    seen = max(last_steps(jobs.out, 0))
    wait_for(jobs, lambda: min(last_steps(jobs.out, 0) + last_steps(jobs.out, 1)) > seen + 3, [a, b])
    os.killpg(server.pid, signal.SIGKILL)
    lost = time.time()
    assert jobs.wait(a, 60) != 0 and jobs.wait(b, 60) != 0  # (exited once torchft's quorum timed out)
    for group, rank in ((0, 0), (1, 0), (1, 1)):
        ended = jobs.out / f"g{group}-error-{rank}.txt"
        message = ended.read_text()
        assert message.startswith("LighthouseLost") and jobs.lighthouse in message, message
        assert ended.stat().st_mtime - lost < 8, "the ranks did not end within seconds"


def replay_alone(record: list, saved: dict) -> tuple[float, float]:
    """Train the unsharded model in this process on the batches of every rank that took part
    in each committed step of ``record`` (job 0's rank; job 1's 2 ranks too where both jobs
    did) up to the step ``saved`` was taken at; its largest difference from ``saved``'s
    parameters, and how far training moved them."""
    from nets import loss_of, make
    from plain_groups import group_batch

    ref = make("tied")
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step, groups, committed, _ in record:
        if not committed or step >= saved["step"]:
            continue
        batches = [group_batch("tied", step, 0, 2, 1)] + ([group_batch("tied", step, 1, 2, 2)] if groups == 2 else [])
        loss_of(ref, torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])).backward()
        opt.step()
        opt.zero_grad()
    diff = max((saved["state"][f"param.{n}"] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    moved = max((start[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    return diff, moved


def start_without_lighthouse(address: str):
    from nets import make

    import shardwise
    import shardwise.ft

    ft = shardwise.ft.Torchft(lighthouse=address, replica_id="g0", timeout=2)
    t0 = time.monotonic()
    try:
        shardwise.shard(make("tied"), fault_tolerance=ft)
    except shardwise.ft.LighthouseUnreachable as e:
        return str(e), time.monotonic() - t0
    return "no error", 0.0


def test_an_unreachable_lighthouse_is_named_at_start(pools):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"http://127.0.0.1:{s.getsockname()[1]}"
    for message, seconds in pools(2).run(start_without_lighthouse, address):
        assert address in message and seconds < 10, message


def test_shardwise_train_with_fault_tolerance(tmp_path, lighthouse):
    """The main job as one replica group (the others' part is the tests above): it trains,
    and keeps its checkpoints, with the committed step count, under its group's name."""
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m", "shardwise",
        "train", "--fault-tolerance", "--replica-id", "node0", "--model-size", "tiny", "--steps", "4",
        "--save-every", "2", "--checkpoint-dir", str(tmp_path / "ck"),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, start_new_session=True)
    assert done.returncode == 0 and "bytes sent per rank per step" in done.stdout, (done.stdout + done.stderr)[-3000:]
    index = json.loads((tmp_path / "ck" / "node0" / "step-00000004" / "index.json").read_text())
    assert index["extra"]["ft"]["step"] == 4


# --- how a job's other replicas learn what its first one's manager decided (ft/place.py)
def tell_and_share(die: bool = False):
    """A pool of 4 as one job of two replicas of 2 shard indexes (ranks 0, 1 the first
    replica): each shard index's first replica tells an object and shares a tensor of its own
    size; the other replicas take them. With ``die``, rank 1 (shard index 1's first replica;
rank 0 hosts the pool's store) dies before it tells."""
    import torch.distributed as dist
    from plain_groups import jobs_in_pool

    from shardwise.core import collectives as C
    from shardwise.core import flight, groups
    from shardwise.ft.place import Place

    _, replicas, replica = jobs_in_pool()
    groups.host_group(replicas)  # (made with the job, in a run: before anyone can die)
    rank = dist.get_rank()
    index = rank % 2
    place = Place(index, 2, replica == 0, replicas)
    C.reset_comm_stats()
    flight.take_digest()
    if die and rank == 1:
        os._exit(7)
    told = place.tell({"index": index, "rows": list(range(3 + 5 * index))} if place.leads else None)
    shared = torch.full((3 + 5 * index,), float(rank))  # (each shard index its own size)
    place.share(None, shared).wait()
    return told, shared.tolist(), flight.take_digest(), C.comm_stats()["broadcast"].calls


def test_other_replicas_take_the_first_ones_outcome_through_counted_checked_broadcasts(pools):
    """What a shard index's first replica tells and shares reaches its other replica, each
    shard index its own size, counted (a length and a payload for an object, one tensor) and
    recorded alike on every rank: the step check, which compares the ranks' digests, agrees."""
    out = pools(4).run(tell_and_share)
    for rank, (told, shared, digest, calls) in enumerate(out):
        index = rank % 2
        assert told == {"index": index, "rows": list(range(3 + 5 * index))}, (rank, told)
        assert shared == [float(index)] * (3 + 5 * index), (rank, shared)  # (the first replica's rank: its index)
        assert calls == 3 and digest == out[0][2] != 0, (rank, calls, digest)


def test_a_first_replica_dead_before_it_tells_ends_the_other_with_a_named_error():
    from pool import WorkerPool

    pool = WorkerPool(4, timeout=60, group_timeout=6.0)
    try:
        t0 = time.monotonic()
        out = pool.run_outcomes(tell_and_share, die=True)
        elapsed = time.monotonic() - t0
    finally:
        pool.close()
    assert out[1].exitcode == 7
    assert not out[3].ok and out[3].error_type.endswith("CollectiveError"), out[3]
    assert "broadcast for unit 'torchft outcome' did not complete" in out[3].error_message, out[3].error_message
    assert elapsed < 6.0 + 20, elapsed
