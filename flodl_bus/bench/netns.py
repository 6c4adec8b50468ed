"""Ranks behind a network: namespaces, veth links, delay and partitions, made here.

``Topology`` creates one server namespace (Redis and the coordinator) and one namespace
per group of ranks, each joined to the server by its own veth pair. Every address is in
127.0.0.0/8 and lives only inside these namespaces: inside each, ``127.0.0.0/8`` is no
longer taken as local as a whole (only 127.0.0.1 is), and ``route_localnet`` lets the
127.0.x.y addresses of the veth ends travel between namespaces. Nothing of the host's
own namespace changes, and nothing leaves the machine.

Delay and loss come from ``tc netem`` on both ends of each link when the kernel has it;
where it does not (a container without ``sch_netem``), ``DelayRelay`` adds the delay in
user space: a TCP relay in the server namespace that holds each chunk for the one-way
delay in each direction (no loss: a relay cannot drop TCP segments). A partition is the
link of a group set down.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Final

#: The server side of group i's link is 127.0.<FIRST + i>.1, the rank side .2.
FIRST_NET: Final = 10


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def netns_problem() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) on PATH"
    name = f"fbprobe{os.getpid()}"
    got = _ip("netns", "add", name, check=False)
    if got.returncode != 0:
        return f"`ip netns add` failed: {got.stderr.strip() or got.returncode}"
    _ip("netns", "del", name, check=False)
    return None


def netem_problem() -> str | None:
    """Why ``tc netem`` cannot delay a link here, or None."""
    if (why := netns_problem()) is not None:
        return why
    if shutil.which("tc") is None:
        return "no `tc` command (iproute2) on PATH"
    name = f"fbprobe{os.getpid()}"
    _ip("netns", "add", name)
    try:
        got = subprocess.run(
            ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
             "delay", "1ms"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if got.returncode != 0:
            return f"tc netem unavailable ({got.stderr.strip()}): no sch_netem in this kernel"
        return None
    finally:
        _ip("netns", "del", name, check=False)


class Topology:
    """A server namespace and ``groups`` rank namespaces, one veth link each."""

    def __init__(
        self, groups: int, *, delay_ms: float = 0.0, loss: float = 0.0, netem: bool = True
    ) -> None:
        if groups < 1 or groups > 200:
            raise ValueError("groups must be 1..200")
        tag = f"fb{os.getpid() % 100000}"
        self.srv = f"{tag}s"
        self.ranks = [f"{tag}r{i}" for i in range(groups)]
        self._srv_if = [f"{tag}s{i}" for i in range(groups)]
        self._rank_if = [f"{tag}r{i}" for i in range(groups)]
        self.hosts = [f"127.0.{FIRST_NET + i}.1" for i in range(groups)]
        self.delay_ms = delay_ms
        self.loss = loss
        self.netem = netem
        self._made: list[str] = []

    def __enter__(self) -> Topology:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _sysctl(self, ns: str, key: str) -> None:
        subprocess.run(
            ["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}=1"], check=True, text=True
        )

    def _own_loopback(self, ns: str) -> None:
        """lo up, but only 127.0.0.1 local: the rest of 127/8 may then be routed."""
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "route", "del", "local", "127.0.0.0/8", "dev", "lo", "table", "local")
        _ip("-n", ns, "route", "replace", "local", "127.0.0.1/32", "dev", "lo", "table", "local")
        self._sysctl(ns, "net.ipv4.conf.all.route_localnet")

    def _qdisc(self, ns: str, dev: str) -> None:
        spec = ["delay", f"{self.delay_ms / 2:.3f}ms"]
        if self.loss:
            spec += ["loss", f"{100 * self.loss:g}%"]
        subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "netem",
             *spec],
            check=True, capture_output=True, text=True,
        )  # fmt: skip

    def _make(self) -> None:
        for ns in (self.srv, *self.ranks):
            _ip("netns", "add", ns)
            self._made.append(ns)
            self._own_loopback(ns)
        for i, (ns, s_if, r_if) in enumerate(
            zip(self.ranks, self._srv_if, self._rank_if, strict=True)
        ):
            _ip("link", "add", s_if, "netns", self.srv, "type", "veth", "peer", "name", r_if,
                "netns", ns)  # fmt: skip
            net = f"127.0.{FIRST_NET + i}"
            for where, dev, addr in ((self.srv, s_if, f"{net}.1"), (ns, r_if, f"{net}.2")):
                self._sysctl(where, f"net.ipv4.conf.{dev}.route_localnet")
                _ip("-n", where, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", where, "link", "set", dev, "up")
                if self.netem and (self.delay_ms or self.loss):
                    self._qdisc(where, dev)

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def cut_command(self, group: int) -> list[str]:
        """The command that partitions ``group`` (its link down, from its side)."""
        return ["ip", "-n", self.ranks[group], "link", "set", "dev", self._rank_if[group], "down"]

    def close(self) -> None:
        # Deleting a namespace deletes the veth ends in it (and so both ends of a pair).
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made = []


# ------------------------------------------------------------------------ relay


class DelayRelay:
    """Forward TCP connections from ``listen`` hosts to ``target``, holding each chunk
    for ``one_way_ms`` in each direction (threads and sleeps: sub-millisecond delays)."""

    def __init__(self, hosts: Sequence[str], port: int, target: tuple[str, int], one_way_ms: float):
        self.delay = one_way_ms / 1000.0
        self.target = target
        self.port = port
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        for host in hosts:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            s.listen(1024)
            self._socks.append(s)
            threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, s: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                client, _ = s.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._pipe(client, upstream)
            self._pipe(upstream, client)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        held: deque[tuple[float, bytes]] = deque()
        ready = threading.Condition()

        def read() -> None:
            while True:
                try:
                    data = src.recv(65536)
                except OSError:
                    data = b""
                with ready:
                    held.append((time.monotonic() + self.delay, data))
                    ready.notify()
                if not data:
                    return

        def write() -> None:
            while True:
                with ready:
                    while not held:
                        ready.wait()
                    due, data = held.popleft()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if not data:
                    for sock in (dst, src):
                        with contextlib.suppress(OSError):
                            sock.shutdown(socket.SHUT_RDWR)
                    return
                try:
                    dst.sendall(data)
                except OSError:
                    return

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        for s in self._socks:
            s.close()
