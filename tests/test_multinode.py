"""Many nodes, really launched: two torchrun agents on this machine, each one "node" of two
ranks, rendezvous over c10d on 127.0.0.1. Hybrid sharding takes the node as shard group; a
job that loses a node restarts on the other one and resumes from its last checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import safetensors.torch
import torch

import shardwise
from shardwise import checkpoint as ckpt
from shardwise.core.addresses import free_port
from shardwise.job import train

TESTS = Path(__file__).resolve().parent
# agents find shardwise where this process did (an installed copy, or this checkout's src/)
PYTHONPATH = os.pathsep.join(
    [str(Path(shardwise.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
)


def agent(
    logs: Path,
    node: str,
    port: int,
    run_id: str,
    nnodes: str,
    host: bool,
    args: list[str],
    *,
    rdzv_conf: str = "",
    restarts: int = 0,
) -> subprocess.Popen:
    """One torchrun agent (a "node" of 2 ranks); its output goes to ``logs/<node>.out|err``.
    ``host``: it serves the rendezvous store (the other agent connects to it). No environment
    variable for restarts: ``shardwise.init()`` keys each attempt's groups apart in torchrun's
    shared store (the launch line of the README)."""
    conf = f"is_host={int(host)}" + (f",{rdzv_conf}" if rdzv_conf else "")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        nnodes,
        "--nproc_per_node",
        "2",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"127.0.0.1:{port}",
        "--rdzv_id",
        run_id,
        "--rdzv_conf",
        conf,
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.2",
        *args,
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TEST_NODE=node,
        PYTHONPATH=PYTHONPATH,
    )
    with open(logs / f"{node}.out", "w") as out, open(logs / f"{node}.err", "w") as err:
        return subprocess.Popen(
            cmd, env=env, stdout=out, stderr=err, text=True, start_new_session=True
        )


def finish(procs: dict[str, subprocess.Popen], logs: Path, timeout: float) -> dict[str, int]:
    """Each agent's exit code; agents still running after ``timeout`` are killed (and fail)."""
    deadline = time.monotonic() + timeout
    codes = {}
    for node, p in procs.items():
        try:
            codes[node] = p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_node(p)
            codes[node] = "timeout"
    return codes


def log(logs: Path, node: str, kind: str) -> str:
    return (logs / f"{node}.{kind}").read_text()


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def kill_node(p: subprocess.Popen) -> None:
    """SIGKILL an agent and every rank it started (they run in sessions of their own)."""
    ranks = children(p.pid)
    for pid in [p.pid, *ranks]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    p.wait()


# --- two agents, the node as shard group: the same training as one process
def test_two_agents_train_hybrid_with_the_node_as_shard_group(tmp_path):
    port, run_id, out = free_port(), uuid.uuid4().hex[:8], tmp_path / "result.json"
    job = [str(TESTS / "multinode_job.py"), str(out)]
    procs = {
        node: agent(tmp_path, node, port, run_id, "2", node == "a", job) for node in ("a", "b")
    }
    codes = finish(procs, tmp_path, timeout=150)
    assert codes == {"a": 0, "b": 0}, (
        codes,
        log(tmp_path, "a", "err")[-3000:],
        log(tmp_path, "b", "err")[-3000:],
    )
    found = json.loads(out.read_text())
    layout = found["layout"]
    for r in layout:  # each shard group is one node's ranks; each replicate group spans both
        assert r["shard_group"] == sorted(x["rank"] for x in layout if x["node"] == r["node"]), (
            layout
        )
        assert {layout[x]["node"] for x in r["replicate_group"]} == {"a", "b"}, layout
    losses, ref_losses, diff, moved = found["result"]
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert a == pytest.approx(b, rel=1e-5), f"step {step}: two nodes {a} vs one process {b}"
    assert moved > 0.05 and diff <= 1e-5


# --- a lost node: the job restarts on the other and resumes from its last checkpoint
STEPS, SAVE_EVERY = 40, 10
TRAIN = [
    "--model-size",
    "tiny",
    "--seq-len",
    "32",
    "--strategy",
    "hybrid_shard",
    "--global-batch-size",
    "8",
    "--steps",
    str(STEPS),
    "--save-every",
    str(SAVE_EVERY),
    "--log-every",
    "10",
    "--resume",
]


def test_lost_node_restarts_on_the_other_and_resumes(pools, tmp_path):
    ckdir, port, run_id = tmp_path / "ckpt", free_port(), uuid.uuid4().hex[:8]
    args = ["-m", "shardwise", "train", *TRAIN, "--checkpoint-dir", str(ckdir)]
    # keep-alive 1 s x 2: a dead agent leaves the rendezvous after 2 s; last call 3 s: the
    # wait for more nodes before a round starts (the second agent joins within it)
    conf = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=2"
    # a first: it serves the rendezvous store, which so outlives node b
    procs = {
        node: agent(
            tmp_path, node, port, run_id, "1:2", node == "a", args, rdzv_conf=conf, restarts=1
        )
        for node in ("a", "b")
    }
    deadline = time.monotonic() + 120
    while ckpt.latest(ckdir) is None and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs.values()), log(tmp_path, "a", "err")[-3000:]
        time.sleep(0.05)
    assert ckpt.latest(ckdir) is not None, "no checkpoint within 120 s"
    kill_node(procs.pop("b"))  # every rank of node b, mid-run, and its agent
    # the survivors time out, restart and resume: slow on a busy 2-core machine
    codes = finish(procs, tmp_path, timeout=240)
    out, err = log(tmp_path, "a", "out"), log(tmp_path, "a", "err")
    assert codes == {"a": 0}, (codes, err[-4000:])
    assert "CollectiveError" in err, err[-6000:]  # the survivors ended with it, then were restarted
    resumed = out.split("resumed from ")[1].split("; RNG")[0]
    path, step = resumed.split(" at step ")
    assert int(step) % SAVE_EVERY == 0 and 0 < int(step) < STEPS and "saved at 4 ranks" in out
    # an uninterrupted run from that checkpoint at world size 2 (a pool of two ranks: one node)
    ref = tmp_path / "ref"
    shutil.copytree(path, ref / Path(path).name)
    cfg = train.parse_args(["--nproc", "2", *TRAIN, "--checkpoint-dir", str(ref)])
    summary = pools(2).run(train.worker, cfg)[0]
    assert f"-> {summary['final_loss']:.3f}" in out  # the same last loss
    last = f"step-{STEPS:08d}"
    index = json.loads((ckdir / last / "index.json").read_text())
    assert index["world_size"] == 2 and index["step"] == STEPS
    for name in index["files"]:  # and bitwise the same model and optimizer state
        got = safetensors.torch.load_file(ckdir / last / name)
        want = safetensors.torch.load_file(ref / last / name)
        assert got.keys() == want.keys()
        for k in got:
            assert torch.equal(got[k], want[k]), (name, k)
