"""The lighthouse: torchft's quorum server, one per training run, and how ranks reach it.

    shardwise lighthouse --port 29510          # or: torchft_lighthouse --min_replicas 1 ...
    TORCHFT_LIGHTHOUSE=http://HOST:29510 torchrun ... train.py   # on every node

``serve`` runs torchft's ``LighthouseServer`` with the settings shardwise's recovery figures
were measured with (docs/fault_tolerance.md): a dead group is dropped after
``heartbeat_timeout_ms`` and a quorum waits at most ``join_timeout_ms`` for stragglers.
``reachable`` and ``local_address`` are plain sockets: a rank asks them without torchft.
"""

from __future__ import annotations

import argparse
import signal
import socket
import threading
from urllib.parse import urlsplit

from ..core.addresses import route_to

DEFAULT_PORT = 29510
HEARTBEAT_TIMEOUT_MS = 2000
JOIN_TIMEOUT_MS = 1000


def host_port(address: str) -> tuple[str, int]:
    """(host, port) of ``http://HOST:PORT`` or ``HOST:PORT``."""
    parts = urlsplit(address if "://" in address else f"http://{address}")
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"lighthouse address {address!r}: use http://HOST:PORT")
    return parts.hostname, parts.port


def url(address: str) -> str:
    """``address`` as the URL torchft's manager connects to."""
    host, port = host_port(address)
    return f"http://{_bracketed(host)}:{port}"


def reachable(address: str, timeout: float = 1.0) -> bool:
    """Whether something accepts connections at the lighthouse's address."""
    host, port = host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def local_address(address: str) -> str:
    """This machine's address on the route to the lighthouse (what other groups can reach too)."""
    return route_to(*host_port(address))


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def serve(
    port: int = DEFAULT_PORT,
    *,
    bind: str = "::",
    min_replicas: int = 1,
    heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS,
    join_timeout_ms: int = JOIN_TIMEOUT_MS,
):
    """Start torchft's lighthouse in this process; returns the server (``.shutdown()``)."""
    from torchft.coordination import LighthouseServer

    return LighthouseServer(
        bind=f"{_bracketed(bind)}:{port}", min_replicas=min_replicas,
        heartbeat_timeout_ms=heartbeat_timeout_ms, join_timeout_ms=join_timeout_ms,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="shardwise lighthouse",
        description="run torchft's lighthouse for fault-tolerant training (shardwise.ft) until interrupted",
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--bind", default="::", help="address to listen on (default: every interface)")
    p.add_argument("--min-replicas", type=int, default=1, help="replica groups a quorum needs")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=HEARTBEAT_TIMEOUT_MS,
                   help="a group silent this long is dropped from the quorum")
    p.add_argument("--join-timeout-ms", type=int, default=JOIN_TIMEOUT_MS,
                   help="how long a quorum waits for groups that still heartbeat")
    a = p.parse_args(argv)
    server = serve(a.port, bind=a.bind, min_replicas=a.min_replicas,
                   heartbeat_timeout_ms=a.heartbeat_timeout_ms, join_timeout_ms=a.join_timeout_ms)
    print(f"lighthouse listening on port {a.port}: TORCHFT_LIGHTHOUSE=http://{socket.gethostname()}:{a.port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
