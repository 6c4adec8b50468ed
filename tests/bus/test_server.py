"""``bus.server``'s ports: one chosen now and bound later by another process."""

from __future__ import annotations

import socket

from flodl_bus.bus.server import _ephemeral_range, free_fixed_port


def test_a_port_chosen_for_a_later_bind_lies_below_the_ephemeral_range_and_is_free() -> None:
    # MASTER_PORT: a port from the ephemeral range could be handed to any socket (a gloo
    # pair, a store) between up's choice and rank 0's bind, which then fails EADDRINUSE.
    low, high = _ephemeral_range()
    assert 1024 < low <= high
    seen = set()
    for _ in range(20):
        port = free_fixed_port()
        assert 10_000 <= port < low
        seen.add(port)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))  # free when chosen
    assert len(seen) > 1  # drawn at random, not one fixed port every launch shares
