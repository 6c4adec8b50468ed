"""Where a process's TCP sockets point: whether a world on one host stayed on loopback.

A world whose ranks share a host is pinned to loopback (``params.hosts.pin_one_host``):
the bootstrap store, gloo's pairs, NCCL's bootstrap sockets and Redis. This reads the
kernel's own view (Linux ``/proc``): the TCP table of the process's network namespace
(``/proc/<pid>/net/tcp`` and ``tcp6``) joined with the socket inodes the process holds
(``/proc/<pid>/fd``). Nothing is asked of the process itself, so a socket opened by a
library (a C++ store, NCCL) is seen as well as one opened from Python.

A listening socket on every address (``0.0.0.0``, ``::``) counts as off loopback: it
talks to nothing yet, but anything that reaches the host can reach it.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

#: the ``st`` column of a listening socket
_LISTEN = "0A"


class Endpoint(NamedTuple):
    local: str
    local_port: int
    remote: str
    remote_port: int
    listening: bool

    def __str__(self) -> str:
        if self.listening:
            return f"listening on {self.local}:{self.local_port}"
        return f"{self.local}:{self.local_port} -> {self.remote}:{self.remote_port}"


def _address(text: str) -> tuple[str, int]:
    """``0100007F:1F90`` (the kernel's hex, each 32-bit word in host order) as an
    address and a port."""
    ip_hex, port_hex = text.split(":")
    raw = bytes.fromhex(ip_hex)
    # /proc prints each 32-bit word of the address as the host stores it (little-endian
    # on every host this runs on), not in network order.
    ordered = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(ordered)
    return str(ip), int(port_hex, 16)


def parse_table(text: str) -> dict[int, Endpoint]:
    """A ``/proc/net/tcp`` or ``tcp6`` table: socket inode -> its endpoint."""
    out: dict[int, Endpoint] = {}
    for line in text.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 10:
            continue
        local, local_port = _address(cols[1])
        remote, remote_port = _address(cols[2])
        out[int(cols[9])] = Endpoint(local, local_port, remote, remote_port, cols[3] == _LISTEN)
    return out


def _socket_inodes(pid: int) -> set[int]:
    inodes: set[int] = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(fd_dir / fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def tcp_endpoints(pid: int) -> list[Endpoint]:
    """The TCP sockets process ``pid`` holds now (OSError: it is gone, or not Linux)."""
    inodes = _socket_inodes(pid)
    table: dict[int, Endpoint] = {}
    for name in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{name}")
        if path.exists():
            table.update(parse_table(path.read_text()))
    return sorted(table[i] for i in inodes if i in table)


def on_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def off_loopback(endpoints: Iterable[Endpoint]) -> list[Endpoint]:
    """The endpoints that are not loopback at both ends (a listener: its own address)."""
    return [
        e
        for e in endpoints
        if not on_loopback(e.local) or (not e.listening and not on_loopback(e.remote))
    ]
