"""plan() inside a training script under torchrun at N=2, as a user writes one: the model
class, ``inputs`` and ``loss`` are the script's own (``__main__``'s), a second model class comes
from a module loaded by path, and lambdas are passed too; none of them could reach another
process. The script plans before ``shardwise.init()`` (each rank alone) and after it (rank 0
for every rank), then trains a step with the plan's choice on the run's own group. Every rank
must print the same plan, and the plan after init() must be the one before it."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import shardwise

NETLIB = '''
import torch.nn as nn


class Wide(nn.Module):
    """A model class of a module loaded by path: not importable by name."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 8)

    def forward(self, x):
        return self.b(self.a(x).relu())
'''

SCRIPT = '''
import hashlib
import importlib.util
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shardwise


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(64, 64) for _ in range(3)))
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        return self.head(self.layers(x).relu())


def inputs():
    return torch.zeros(16, 64), torch.zeros(16, dtype=torch.long)


def loss(model, x, y):
    return F.cross_entropy(model(x), y)


def digest(p):
    return hashlib.sha256(repr((p.estimates, p.choice, p.reason)).encode()).hexdigest()[:16]


def main():
    spec = importlib.util.spec_from_file_location("netlib", sys.argv[1])
    netlib = importlib.util.module_from_spec(spec)  # (not in sys.modules: pickle cannot find it)
    spec.loader.exec_module(netlib)
    kw = dict(world_size=2, wrap=shardwise.wrap.by_class(nn.Linear), inputs=inputs, loss=loss)
    before = shardwise.plan(Net, budget="1GiB", **kw)
    shardwise.init()
    t0 = time.perf_counter()
    after = shardwise.plan(Net, budget="1GiB", **kw)
    seconds = time.perf_counter() - t0
    by_path = shardwise.plan(netlib.Wide, strategy="full_shard", **kw)
    lambdas = shardwise.plan(
        lambda: Net(), strategy="full_shard", world_size=2, inputs=lambda: inputs(), loss=lambda m, x, y: loss(m, x, y)
    )
    rank = dist.get_rank()
    print(
        f"rank {rank}: before {digest(before)} after {digest(after)} by_path {digest(by_path)} "
        f"lambdas {digest(lambdas)} in {seconds:.1f} s",
        flush=True,
    )
    # the run's own group is as it was: a real step with the plan's choice
    model = shardwise.shard(Net(), plan=after)  # its wrap, strategy and per-unit settings
    opt = torch.optim.AdamW(model.parameters())
    loss(model, *inputs()).backward()
    opt.step()
    print(f"rank {rank}: trained with {after.choice.strategy}", flush=True)


if __name__ == "__main__":
    main()
'''


def test_plan_in_a_torchrun_script_before_and_after_init(tmp_path):
    (tmp_path / "netlib.py").write_text(textwrap.dedent(NETLIB))
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    src = str(Path(shardwise.__file__).resolve().parents[1])  # this checkout's shardwise
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(script), str(tmp_path / "netlib.py")],
        capture_output=True, text=True, timeout=180, check=False, env=env,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    # (two ranks print at once: a line may run into the other's, so match the digests alone)
    lines = dict(re.findall(r"rank (\d): (before \w+ after \w+ by_path \w+ lambdas \w+)", run.stdout))
    assert set(lines) == {"0", "1"}, run.stdout
    assert lines["0"] == lines["1"]  # every rank got the same plans
    digests = dict(re.findall(r"(\w+) ([0-9a-f]{16})", lines["0"]))
    assert digests["before"] == digests["after"]  # planned alone or for the run: the same plan
    assert len(re.findall(r"rank \d: trained with no_shard", run.stdout)) == 2
    print(run.stdout)


# A script that plans after shardwise.init() and ends without destroy_process_group(), as the
# issue's did. Each rank is a child forked from one warm launcher (ten torchrun jobs would pay
# for importing torch twenty times) and leaves through the interpreter's normal exit, as a
# script does. Gloo's worker thread releases plan()'s broadcast a moment after the ranks move
# on (Note [exit] in groups.py); a long GIL switch interval keeps the main thread from handing
# the GIL over before the script ends, which widens that window: without the fix about one
# run in three aborted this way (SIGABRT, exit code -6).
EXITING = '''
import os
import socket
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise


def inputs():
    return torch.zeros(4, 16), torch.zeros(4, dtype=torch.long)


def loss(model, x, y):
    return F.cross_entropy(model(x), y)


def net():
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


KW = dict(world_size=2, strategy="full_shard", inputs=inputs, loss=loss)
shardwise.plan(net, **KW)  # (the planner's own imports, once, before forking)
codes = []
for run in range(int(sys.argv[1])):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    children = []
    for rank in range(2):
        if os.fork() == 0:  # a rank: plan, then end as the script ends
            os.environ.update(
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                LOCAL_RANK=str(rank),
            )
            sys.setswitchinterval(30)
            shardwise.init()
            shardwise.plan(net, **KW)
            break
        children.append(None)
    else:
        for _ in children:
            _, status = os.wait()
            codes.append(os.waitstatus_to_exitcode(status))
        continue
    break
else:
    print("exit codes", codes, flush=True)
'''


def test_a_script_that_plans_exits_cleanly_without_destroying_its_group(tmp_path):
    script = tmp_path / "plan_and_exit.py"
    script.write_text(textwrap.dedent(EXITING))
    src = str(Path(shardwise.__file__).resolve().parents[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, str(script), "10"], capture_output=True, text=True, timeout=300, check=False, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    codes = re.search(r"exit codes \[([-\d, ]*)\]", run.stdout)
    assert codes, run.stdout + run.stderr[-3000:]
    codes = [int(c) for c in codes.group(1).split(",")]
    assert codes == [0] * 20, (codes, run.stderr[-3000:])  # 10 runs of 2 ranks, every exit 0
    assert "terminate called" not in run.stderr
