"""A local Redis Cluster on loopback ports (tests and ``bench scale --cluster``).

Each node is a ``server.RedisServer`` with ``--cluster-enabled yes`` in its own directory.
The cluster is formed with plain commands through redis-py (no ``redis-cli`` needed):
CLUSTER MEET, CLUSTER ADDSLOTSRANGE on the masters (equal shares of the 16,384 slots),
CLUSTER REPLICATE on the replicas; ``start`` returns once every node says
``cluster_state:ok`` and every replica is attached.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import redis
from redis.crc import REDIS_CLUSTER_HASH_SLOTS

from flodl_bus.bus.server import RedisServer, RedisServerError, free_port


class LocalCluster:
    """``masters`` masters with ``replicas`` replicas each, on 127.0.0.1."""

    def __init__(
        self,
        *,
        masters: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 1000,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.directory = tempfile.mkdtemp(prefix="flodl-cluster-")
        self.node_timeout_ms = node_timeout_ms
        self.n_masters = masters
        self.nodes: list[RedisServer] = []
        self.bus_ports: list[int] = []
        for i in range(masters * (1 + replicas)):
            self.bus_ports.append(free_port())
            d = f"{self.directory}/n{i}"
            os.makedirs(d, exist_ok=True)
            self.nodes.append(
                RedisServer(
                    directory=d,
                    extra_args=[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        f"{d}/nodes.conf",
                        # the bus port's default (port + 10000) may lie beyond 65535
                        "--cluster-port",
                        str(self.bus_ports[-1]),
                        "--cluster-node-timeout",
                        str(node_timeout_ms),
                        # the other shards keep serving while one has no master
                        "--cluster-require-full-coverage",
                        "no",
                        # a lone replica may take over at once (no data-age veto)
                        "--cluster-replica-validity-factor",
                        "0",
                        *extra_args,
                    ],
                )
            )

    def _start_node(self, i: int, n: RedisServer, tries: int = 3) -> None:
        # Its two ports were free when chosen, not held since: another process (a test's
        # outgoing connection) may have taken one, and the server then exits at once.
        for attempt in range(tries):
            try:
                n.start()
                return
            except RedisServerError:
                if attempt == tries - 1:
                    raise
                n.port = free_port()
                bus = n.extra_args.index("--cluster-port") + 1
                self.bus_ports[i] = free_port()
                n.extra_args[bus] = str(self.bus_ports[i])

    @property
    def masters(self) -> list[RedisServer]:
        return self.nodes[: self.n_masters]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:2])

    def client(self, i: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.nodes[i].port, socket_timeout=5)

    def node_id(self, i: int) -> str:
        c = self.client(i)
        try:
            return str(c.execute_command("CLUSTER MYID").decode())  # type: ignore[no-untyped-call]
        finally:
            c.close()

    def start(self, timeout: float = 30.0) -> LocalCluster:
        for i, n in enumerate(self.nodes):
            self._start_node(i, n)
        first = self.client(0)
        for n, bus in zip(self.nodes[1:], self.bus_ports[1:], strict=True):
            first.execute_command("CLUSTER MEET", "127.0.0.1", n.port, bus)  # type: ignore[no-untyped-call]
        share = REDIS_CLUSTER_HASH_SLOTS // self.n_masters
        for i in range(self.n_masters):
            lo = i * share
            hi = REDIS_CLUSTER_HASH_SLOTS - 1 if i == self.n_masters - 1 else lo + share - 1
            c = self.client(i)
            c.execute_command("CLUSTER ADDSLOTSRANGE", lo, hi)  # type: ignore[no-untyped-call]
            c.close()
        ids = [self.node_id(i) for i in range(self.n_masters)]
        deadline = time.monotonic() + timeout
        for j in range(self.n_masters, len(self.nodes)):
            master = ids[(j - self.n_masters) % self.n_masters]
            c = self.client(j)
            # The replica must have heard of its master (gossip) before REPLICATE works.
            self._until(
                lambda c=c, m=master: m in str(c.execute_command("CLUSTER NODES")),
                deadline,
                "replica meets its master",
            )
            c.execute_command("CLUSTER REPLICATE", master)  # type: ignore[no-untyped-call]
            c.close()
        for i in range(len(self.nodes)):
            self._until(lambda i=i: self.ok(i), deadline, f"node {i} cluster_state:ok")
        for j in range(self.n_masters, len(self.nodes)):
            self._until(lambda j=j: self.replica_linked(j), deadline, f"replica {j} in sync")
        first.close()
        return self

    def ok(self, i: int) -> bool:
        c = self.client(i)
        try:
            info: Any = c.execute_command("CLUSTER INFO")  # type: ignore[no-untyped-call]
        except redis.exceptions.ConnectionError:
            return False
        finally:
            c.close()
        if isinstance(info, dict):  # redis-py parses it
            return bool(info.get("cluster_state") == "ok")
        return b"cluster_state:ok" in info

    def replica_linked(self, j: int) -> bool:
        c = self.client(j)
        try:
            info: Any = c.info("replication")
        finally:
            c.close()
        return bool(info.get("role") == "slave" and info.get("master_link_status") == "up")

    def master_of_port(self, port: int) -> int | None:
        """The index of the node at ``port`` (None if no node has it)."""
        for i, n in enumerate(self.nodes):
            if n.port == port:
                return i
        return None

    def replica_of(self, i: int) -> int:
        """The index of a replica of master ``i``."""
        my = self.node_id(i)
        for j in range(len(self.nodes)):
            if j == i or self.nodes[j].proc is None:
                continue
            c = self.client(j)
            try:
                info: Any = c.info("replication")
                port = int(info.get("master_port", -1))
            finally:
                c.close()
            if info.get("role") == "slave" and self.nodes[i].port == port:
                return j
        raise RedisServerError(f"master {i} ({my}) has no replica")

    @staticmethod
    def _until(pred: Any, deadline: float, what: str) -> None:
        while True:
            try:
                if pred():
                    return
            except redis.exceptions.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RedisServerError(f"local cluster: timed out waiting for {what}")
            time.sleep(0.02)

    def cleanup(self) -> None:
        for n in self.nodes:
            n.cleanup()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()
