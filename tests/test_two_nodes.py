"""Two nodes joined by a real, shaped link (shardwise.bench.netns): two network namespaces and
a veth pair at 100 Mbit/s, a torchrun agent in each with c10d rendezvous across the link, Gloo
bound to the veth. hybrid_shard trains across it (one rank per node: the nodes are replicas),
exactly and with int8 on the link; cross-node bytes equal the theory. Skips, saying why, where
namespaces cannot be made (not root, no iproute2)."""

import json
import subprocess
import uuid
from pathlib import Path

import pytest

from shardwise.bench import netns
from shardwise.core.addresses import free_port

HERE = Path(__file__).resolve().parent
WHY = netns.unavailable()


@pytest.mark.skipif(bool(WHY), reason=f"two nodes on one machine: {WHY}")
def test_hybrid_trains_across_a_shaped_link(tmp_path):
    out = tmp_path / "result.json"
    port = free_port()  # a port number; the namespaces have every port free anyway
    with netns.two_nodes(rate="100mbit") as link:
        run_id = uuid.uuid4().hex[:8]
        agents = [
            link.agent(node, 1, [str(HERE / "two_nodes_job.py"), str(out)], port=port, run_id=run_id,
                       log=tmp_path / f"node{node}.log", env={"OMP_NUM_THREADS": "1"})
            for node in (0, 1)
        ]
        try:
            codes = [a.wait(timeout=240) for a in agents]
        except subprocess.TimeoutExpired:
            for a in agents:
                a.kill()
            codes = ["timeout"] * 2
    logs = "\n".join((tmp_path / f"node{n}.log").read_text()[-3000:] for n in (0, 1))
    assert codes == [0, 0], logs
    result = json.loads(out.read_text())
    for comm, r in result.items():
        assert r["replica_bytes"] == r["expected"] > 0, (comm, r)
        assert all(loss > 0 for loss in r["losses"])
    assert result["int8"]["replica_bytes"] < 0.3 * result["exact"]["replica_bytes"]
    for a, b in zip(result["int8"]["losses"], result["exact"]["losses"]):
        assert a == pytest.approx(b, rel=0.02)
