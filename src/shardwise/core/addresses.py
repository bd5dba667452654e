"""This machine's addresses, as its peers (other ranks, jobs, engines) reach it: a free port,
and the address on the route toward a peer, IPv4 or IPv6. Plain sockets; nothing is sent."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (the kernel's pick; another process may take it before
    the caller binds it, so use it at once)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def route_to(host: str, port: int = 9) -> str:
    """This machine's address on the route toward ``host`` (the source address the kernel picks
    for it: what the peer can reach too, where one address serves them all). ``host`` may be a
    name, an IPv4 or an IPv6 address; raises ``OSError`` when there is no route."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    # a name with both: IPv4, as the peers' own lookups most often pick
    family, _, _, _, target = min(found, key=lambda a: a[0] != socket.AF_INET)
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(target)  # UDP: a route is chosen, no packet is sent
        return s.getsockname()[0]
