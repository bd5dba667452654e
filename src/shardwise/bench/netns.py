"""Two nodes on one machine, joined by a real, shaped link: network namespaces and a veth pair.

``two_nodes(rate)`` makes two network namespaces, puts one end of a veth pair in each with an
address from 10.213.0.0/24 (used only inside them), brings ``lo`` up in both and shapes each
end's egress with a token bucket (``tc ... tbf``: ``rate`` each way), plus a propagation delay
where the kernel has netem. Everything is deleted on exit, whatever happened. ``Link.agent``
starts a torchrun agent in a namespace, following shared/notes/two-node-link.md: node A hosts
the c10d rendezvous (``is_host=1``), each agent gives its own address (``--local_addr``) and
Gloo is bound to the veth (``GLOO_SOCKET_IFNAME``); ranks of one node talk over its own ``lo``.
Needs root and iproute2 (``ip``, ``tc``); ``unavailable()`` says why not, where not.
``sink`` and ``send_rate`` measure what the link carries (a plain TCP transfer).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.213.0"
ADDRESSES = (f"{SUBNET}.1", f"{SUBNET}.2")  # node A's and node B's, in every pair of namespaces


def unavailable() -> str:
    """Why namespaces cannot be made here ("" where they can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed: apt-get install -y iproute2"
    probe = f"swP{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return ""


@dataclass(frozen=True)
class Link:
    """The two nodes: namespace, veth device and address of each (A hosts the rendezvous)."""

    namespaces: tuple[str, str]
    devices: tuple[str, str]
    addresses: tuple[str, str]

    def agent(
        self, node: int, nproc: int, args: Sequence[str], *, port: int = 29531, run_id: str = "shardwise",
        log: Path | None = None, env: dict | None = None, max_restarts: int = 0,
    ) -> subprocess.Popen:
        """One torchrun agent of ``nproc`` ranks on node ``node`` running ``python args``, in
        the node's namespace with Gloo bound to its veth (a job across both nodes)."""
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--nproc_per_node", str(nproc), "--max_restarts", str(max_restarts),
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{self.addresses[0]}:{port}", "--rdzv_id", run_id,
            "--rdzv_conf", f"is_host={int(node == 0)}", "--local_addr", self.addresses[node],
            *args,
        ]
        return self.run(node, cmd, log=log, env=env)

    def run(
        self, node: int, cmd: Sequence[str], *, log: Path | None = None, env: dict | None = None,
        session: bool = False,
    ) -> subprocess.Popen:
        """``cmd`` in node ``node``'s namespace, with Gloo bound to its veth (e.g. a torchrun
        job of its own on that node); ``session``: in a session of its own, so that
        ``os.killpg(proc.pid, ...)`` stops it with every child (a server)."""
        out = open(log, "w") if log is not None else None  # noqa: SIM115 (the child holds it)
        env = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": self.devices[node]}
        return subprocess.Popen(
            ["ip", "netns", "exec", self.namespaces[node], *cmd], env=env, stdout=out,
            stderr=subprocess.STDOUT if out else None, start_new_session=session,
        )


_RATE = re.compile(r"\d+(\.\d+)?([kmgt]?bit|[kmgt]?bps)", re.IGNORECASE)


def _bad_rate(rate: str) -> str | None:
    if _RATE.fullmatch(rate):
        return None
    return f"{rate!r} is not a link rate tc takes: a number and a unit, e.g. 10gbit, 1gbit, 100mbit, 500kbit"


def link_rate(text: str) -> str:
    """``--link``'s type: ``text`` if tc takes it as a rate, else argparse's error naming the units."""
    if problem := _bad_rate(text):
        raise argparse.ArgumentTypeError(problem)
    return text


@contextlib.contextmanager
def two_nodes(rate: str = "1gbit", delay: str = "1ms", burst: str = "1mb") -> Iterator[Link]:
    """Two namespaces joined by a veth pair shaped to ``rate`` each way (``tc`` units: 1gbit,
    100mbit, ...) with ``delay`` of propagation where netem exists; deleted on exit."""
    if problem := _bad_rate(rate):
        raise ValueError(problem)
    tag = uuid.uuid4().hex[:6]  # several harnesses may run on one machine at once
    ns, dev = (f"swA{tag}", f"swB{tag}"), (f"swa{tag}", f"swb{tag}")
    addrs = ADDRESSES
    try:
        _ip("netns", "add", ns[0])
        _ip("netns", "add", ns[1])
        _ip("link", "add", dev[0], "type", "veth", "peer", "name", dev[1])
        netem = True
        for n, d, a in zip(ns, dev, addrs):
            _ip("link", "set", d, "netns", n)
            _ip("-n", n, "addr", "add", f"{a}/24", "dev", d)
            _ip("-n", n, "link", "set", d, "up")
            _ip("-n", n, "link", "set", "lo", "up")
            tc = ["ip", "netns", "exec", n, "tc", "qdisc", "add", "dev", d]
            if netem and delay:
                netem = subprocess.run([*tc, "root", "handle", "1:", "netem", "delay", delay], capture_output=True, check=False).returncode == 0
            parent = ["parent", "1:", "handle", "2:"] if netem and delay else ["root"]
            _run([*tc, *parent, "tbf", "rate", rate, "burst", burst, "latency", "100ms"])
        yield Link(ns, dev, addrs)
    finally:
        for n in ns:  # deleting a namespace deletes its end of the pair, and so the pair
            subprocess.run(["ip", "netns", "del", n], capture_output=True, check=False)


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")


# --- what the link carries: a plain TCP transfer from node A to a sink on node B
def sink(port: int) -> None:
    """Serve forever on ``port``: read each connection until the sender closes its side, then
    answer one byte (``send_rate`` times up to that byte: the bytes have all arrived)."""
    with socket.create_server(("", port), backlog=4) as server:
        while True:
            conn, _ = server.accept()
            with conn, contextlib.suppress(OSError):  # a sender that went away: the next one
                while conn.recv(1 << 20):
                    pass
                conn.sendall(b"k")


def send_rate(host: str, port: int, nbytes: int, tries: int = 3) -> float:
    """Bytes per second of ``nbytes`` sent over plain TCP to a ``sink`` on ``host:port``
    (best of ``tries``, connection set-up excluded): the bandwidth a link delivers."""
    chunk = memoryview(bytearray(1 << 20))
    best = float("inf")
    for _ in range(tries):
        with socket.create_connection((host, port), timeout=300) as s:
            t0 = time.perf_counter()
            for sent in range(0, nbytes, len(chunk)):
                s.sendall(chunk[: min(len(chunk), nbytes - sent)])
            s.shutdown(socket.SHUT_WR)
            if s.recv(1) != b"k":
                raise RuntimeError(f"the sink on {host}:{port} closed before acknowledging {nbytes} bytes")
            best = min(best, time.perf_counter() - t0)
    return nbytes / best


def without_nproc(argv: list[str]) -> list[str]:
    """``argv`` less ``--nproc``: torchrun's parser takes it for its own ``--nproc_per_node``
    even after the module's name (and a rank under torchrun ignores it anyway)."""
    out, args = [], iter(argv)
    for arg in args:
        if arg == "--nproc":
            next(args, None)
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out
