"""``shardwise bench --nodes 2 --diloco`` run tiny (two steps a round, the exchange overlapping the
second, one timed round, one rank a node) so that the mode cannot rot: every system trains
across the shaped link, the report holds its throughput, its link bytes per token and its
loss at every step, DiLoCo with top-k messages sends fewer bytes across the link than exact
hybrid sharding, and DiLoCo after a step of warm-up starts from exact hybrid's model and
batch (the losses compare at equal tokens). Skips, saying why, where namespaces cannot be made (not root, no iproute2) or torchft is missing."""

import json
import os
import subprocess
import sys

import pytest

from shardwise.bench import netns

WHY = netns.unavailable()
pytest.importorskip("torchft", reason="DiLoCo needs torchft: pip install -e '.[ft]'")


@pytest.mark.skipif(bool(WHY), reason=f"two nodes on one machine: {WHY}")
def test_diloco_bench_runs_tiny_across_a_shaped_link(tmp_path):
    systems = ("shardwise/hybrid_shard", "diloco+topk")
    cmd = [
        sys.executable, "-m", "shardwise", "bench", "--nodes", "2", "--diloco", "--model", "tiny", "--nproc", "1",
        "--sync-every", "2", "--fragment-sync-delay", "1", "--rounds", "1", "--exact-steps", "1", "--batch-size", "1", "--seq-len", "16",
        "--link", "1gbit", "--systems", ",".join(systems), "--warmup-steps", "1", "--out", str(tmp_path),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "diloco.json").read_text())["rows"]
    assert list(rows) == list(systems)
    for name, row in rows.items():
        assert row["tokens_per_s"] > 0 and len(row["losses"]) in (3, 4), (name, row)  # (untimed and timed steps)
        assert all(2.0 < loss < 10.0 for loss in row["losses"]), (name, row["losses"])  # (a byte GPT's loss)
    assert rows["diloco+topk"]["link_bytes_per_token"] * 5 < rows["shardwise/hybrid_shard"]["link_bytes_per_token"], rows
    # equal tokens: DiLoCo starts from exact hybrid's model and AdamW after its first step and reads
    # the same rows of step 2's batch, so its first loss (the mean of each node's first rank's) is
    # exact hybrid's second
    second = rows["shardwise/hybrid_shard"]["losses"][1]
    assert abs(rows["diloco+topk"]["losses"][0] - second) < 1e-5 * second, (rows["diloco+topk"]["losses"][0], second)
    assert "| diloco+topk |" in (tmp_path / "diloco.md").read_text()
