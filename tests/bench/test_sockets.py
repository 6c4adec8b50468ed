"""``bench.sockets``: the kernel's TCP table read back, and what counts as loopback.

Sockets this test opens are on loopback only; what lies off it is shown with table
text as the kernel prints it, never with a real socket."""

from __future__ import annotations

import os
import socket

from flodl_bus.bench.sockets import Endpoint, off_loopback, on_loopback, parse_table, tcp_endpoints

HEAD = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  inode\n"


def _row(local: str, remote: str, state: str, inode: int) -> str:
    return f"   0: {local} {remote} {state} 00000000:00000000 00:00000000 0 0 0 {inode} 1\n"


def test_a_table_is_read_as_the_kernel_prints_it() -> None:
    table = parse_table(
        HEAD
        + _row("0100007F:1F90", "00000000:0000", "0A", 11)  # 127.0.0.1:8080, listening
        + _row("0100007F:A000", "0100007F:1F90", "01", 12)  # 127.0.0.1:40960 -> :8080
        + _row("0A00000A:1F90", "0B00000A:D431", "01", 13)  # 10.0.0.10:8080 -> 10.0.0.11
        + _row("00000000:1F91", "00000000:0000", "0A", 14)  # 0.0.0.0:8081, listening
    )
    assert table[11] == Endpoint("127.0.0.1", 8080, "0.0.0.0", 0, True)
    assert table[12] == Endpoint("127.0.0.1", 40960, "127.0.0.1", 8080, False)
    assert table[13] == Endpoint("10.0.0.10", 8080, "10.0.0.11", 54321, False)
    assert off_loopback(table.values()) == [table[13], table[14]]
    assert str(table[14]) == "listening on 0.0.0.0:8081"


def test_ipv6_rows_and_mapped_loopback() -> None:
    table = parse_table(
        HEAD
        # ::1 port 80, listening
        + _row(
            "00000000000000000000000001000000:0050",
            "00000000000000000000000000000000:0000",
            "0A",
            21,
        )
        # ::ffff:127.0.0.1 -> ::ffff:127.0.0.1
        + _row(
            "0000000000000000FFFF00000100007F:0051",
            "0000000000000000FFFF00000100007F:0052",
            "01",
            22,
        )
        # :: port 82, listening: every address
        + _row(
            "00000000000000000000000000000000:0052",
            "00000000000000000000000000000000:0000",
            "0A",
            23,
        )
    )
    assert table[21].local == "::1" and table[21].listening
    assert table[22].local == "::ffff:7f00:1"
    assert on_loopback(table[22].local) and on_loopback(table[22].remote)
    assert off_loopback(table.values()) == [table[23]]


def test_a_process_s_own_loopback_sockets_are_found_by_inode() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    client = socket.create_connection(server.getsockname())
    try:
        port = server.getsockname()[1]
        mine = tcp_endpoints(os.getpid())
        assert Endpoint("127.0.0.1", port, "0.0.0.0", 0, True) in mine
        assert any(e.remote_port == port and not e.listening for e in mine)
        assert not off_loopback([e for e in mine if port in (e.local_port, e.remote_port)])
    finally:
        client.close()
        server.close()
