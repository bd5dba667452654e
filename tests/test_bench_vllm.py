"""``shardwise bench --vllm``'s pieces that need no engine: its flags, the floor's arithmetic
and table, and the link probe (a plain TCP transfer, here over loopback). The bench itself
starts vLLM engines: it is run by hand (docs/rl.md "Measured"), not here."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from shardwise.bench import netns, vllm_link, vllm_push


def test_two_node_flags():
    cfg = vllm_push.parse_args(["--nodes", "2", "--link", "100mbit", "--port", "18650", "--size", "medium"])
    assert (cfg.nodes, cfg.link, cfg.port, cfg.size) == (2, "100mbit", 18650, "medium")
    assert vllm_push.parse_args([]).nodes == 1
    with pytest.raises(SystemExit):
        vllm_push.parse_args(["--nodes", "3"])
    with pytest.raises(SystemExit):  # argparse names it: "... not a link rate tc takes ..."
        vllm_push.parse_args(["--nodes", "2", "--link", "1gigabit"])
    with pytest.raises(ValueError, match=r"not a link rate tc takes.*100mbit"), netns.two_nodes(rate="fast"):
        pass
    assert netns.link_rate("2.5Gbit") == "2.5Gbit"
    assert vllm_link.engine_url(18650) == f"http://{netns.ADDRESSES[1]}:18650"
    cmd = vllm_link.serve_command("/m", 18650)
    assert cmd[cmd.index("--host") + 1] == netns.ADDRESSES[1] and cmd[cmd.index("--port") + 1] == "18650"
    assert cmd[cmd.index("--weight-transfer-config") + 1] == '{"backend": "shardwise"}'


def _result(naive: bool) -> dict:
    r = {
        "world": 2, "size": "medium", "params": 40_000_000, "wire_bytes": 100 << 20,
        "largest_unit_bytes": 16 << 20, "bucket_bytes": 64 << 20, "floor_bytes_per_s": 125e6,
        "shardwise": {"seconds": 1.2583, "all_seconds": [1.2583], "extra_bytes": 90 << 20, "engine_wait_seconds": 0.1,
                      "pause_seconds": 1.0},
        "delta": {"bytes_ratio": 0.07, "all_ratios": [0.07], "seconds": 0.4194, "pause_seconds": 0.1},
        "overlap": {"step_seconds": 0.2, "step_beside_push_seconds": 0.23, "wait_after_step_seconds": 0.9,
                    "all_alone": [0.2], "all_beside": [0.23]},
    }
    if naive:
        r["naive"] = {"seconds": 2.5166, "all_seconds": [2.5166], "extra_bytes": 200 << 20}
    return r


def _rows(path) -> dict[str, list[str]]:
    rows = [line.strip("|").split("|") for line in path.read_text().splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


def test_floor_is_the_bytes_over_the_links_bandwidth(tmp_path):
    cfg = vllm_push.Config(nodes=2, link="1gbit", out=str(tmp_path))
    vllm_push.report(cfg, _result(naive=False))
    rows = _rows(tmp_path / "bench_vllm.md")
    floor = (100 << 20) / 125e6  # 0.839 s
    assert rows["floor (bytes / 1gbit link's measured bandwidth)"][:1] == [f"{floor:.3f}"]
    push = rows["shardwise push (tcp, 1gbit link, bf16)"]
    assert push[0] == "1.258" and push[1] == "1.000" and push[3] == f"{1.2583 / floor:.2f}" == "1.50" and push[4] == ""
    assert rows["shardwise delta push (tcp, 1gbit link, lr 1e-05)"][1:4:2] == ["0.100", f"{0.4194 / floor:.2f}"]
    assert "delta's engine pause <= 0.1x a full push's: 0.08" in (tmp_path / "bench_vllm.md").read_text()
    assert not any(name.startswith("naive") for name in rows)  # no shared filesystem across a link
    saved = json.loads((tmp_path / "bench_vllm.json").read_text())
    assert saved["config"]["nodes"] == 2 and saved["floor_bytes_per_s"] == 125e6


def test_one_node_floor_is_the_copy_and_naive_is_compared(tmp_path):
    vllm_push.report(vllm_push.Config(out=str(tmp_path)), _result(naive=True))
    rows = _rows(tmp_path / "bench_vllm.md")
    assert "floor (bytes / copy bandwidth)" in rows
    assert rows["shardwise push (shm, bf16)"][4] == f"{1.2583 / 2.5166:.2f}" == "0.50"
    assert rows["naive: full_state_dict + reload_weights"][1:3] == ["", "200.0 MiB"]
    assert ("step (AdamW, 2 x 64 tokens) alone 0.200 s, with a full push(wait=False) beside it 0.230 s "
            "(1.15x; target <= 1.15x); the push then went on 0.900 s") in (tmp_path / "bench_vllm.md").read_text()


def test_send_rate_times_a_transfer_until_the_sink_has_it_all():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threading.Thread(target=netns.sink, args=(port,), daemon=True).start()
    for _ in range(100):  # until the sink listens
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            threading.Event().wait(0.05)
    nbytes = (8 << 20) + 12345  # not a whole number of chunks
    rate = netns.send_rate("127.0.0.1", port, nbytes, tries=2)
    assert 1e6 < rate < 1e12


def test_several_engines_flags_and_table(tmp_path):
    """``--engines K``: K local ``vllm serve`` on ports --port + k; the table holds each
    count's push and pause and its ratio to one engine's."""
    from shardwise.bench import vllm_engines

    cfg = vllm_push.parse_args(["--engines", "3", "--port", "18700", "--out", str(tmp_path)])
    assert vllm_engines.engine_urls(cfg) == [f"http://127.0.0.1:{p}" for p in (18700, 18701, 18702)]
    with pytest.raises(SystemExit):  # the engines run on this machine
        vllm_push.parse_args(["--engines", "2", "--nodes", "2"])
    cmd = vllm_link.serve_command("/m", 18700, host="127.0.0.1")
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    runs = [{"engines": k, "seconds": s, "all_seconds": [s], "pause_seconds": p, "wire_bytes": 80 << 20,
             "engine_cpu_seconds": 0.3 * k, "machine_cpu_seconds": 1.2 * s}
            for k, s, p in ((1, 0.5, 0.4), (2, 0.55, 0.45), (3, 0.6, 0.5))]
    vllm_engines.report(cfg, {"world": 2, "size": "medium", "params": 42_000_000, "runs": runs, "cores": 2})
    rows = _rows(tmp_path / "bench_vllm_engines.md")
    assert rows["2"] == ["0.550", "1.10", "0.450", "0.60", "0.66", "1.20 of 2"]
    assert rows["3"] == ["0.600", "1.20", "0.500", "0.90", "0.72", "1.20 of 2"]
    assert "<= 1.3x one engine's: 1.20" in (tmp_path / "bench_vllm_engines.md").read_text()
