"""This machine's addresses toward a peer (shardwise.core.addresses), IPv4 and IPv6."""

from __future__ import annotations

import socket

import pytest

from shardwise.core.addresses import free_port, route_to


def test_a_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_the_route_toward_a_loopback_peer_starts_at_loopback():
    assert route_to("127.0.0.1", 29510) == "127.0.0.1"
    assert route_to("localhost") == "127.0.0.1"  # a name with both: IPv4


def test_the_route_toward_an_ipv6_peer_is_ipv6():
    if not socket.has_ipv6:
        pytest.skip("this machine has no IPv6")
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    assert route_to("::1", 29510) == "::1"
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", free_port("::1")))
