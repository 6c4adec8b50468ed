"""The control plane on a Redis Cluster (opt in: a ``redis+cluster://`` URL).

A run on a cluster is S shards (``keys.RunKeys.shards``): rank r's streams and its
shard's broadcast stream share the tag ``{RUN:n}``, run-wide keys stay under ``{RUN}``.
Every bus actor talks to the master of ONE slot through a plain client pinned to it
(``pinned_client``), so the whole single-Redis bus (explicit ids, WATCH/MULTI/EXEC
batches, multi-key XREADGROUP, raw replies) runs unchanged within that slot. redis-py's
``RedisCluster`` is not used: it retries a command after a lost connection behind the
caller's back, which the bus must never do with a write (``connection``'s docstring).

How the pinned client follows the cluster:

- each new connection asks a live node which master serves its slot (CLUSTER SLOTS),
  so after a failover the next connect lands on the promoted replica;
- a ``MOVED``/``ASK`` reply (the slot moved, the node is a replica now) makes ``Link``
  drop every connection of the client and retry, one ``redis_write_blocked`` line per
  episode; ``TRYAGAIN`` and ``CLUSTERDOWN`` are transient refusals like ``OOM``.

Durability: Redis replicates asynchronously, so an entry a master acknowledged may be
missing on the replica that replaces it. The coordinator follows each control write with
``WAIT 1 <ms>`` (``confirm``); an entry no replica acknowledged is kept, named
(``bus_replication_unconfirmed``) and, should a failover lose it, written again with the
same id, seq and MAC (``bus_control_lost``, ``streams.RedisCoordinatorBus``).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import unquote

import redis
from redis.connection import Connection, SSLConnection
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from flodl_bus.bus.keys import RunKeys

SCHEMES: Final = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
ENV_CLUSTER: Final = "FLODL_REDIS_CLUSTER"
#: how long the coordinator's WAIT waits for a replica to acknowledge a control write
DEFAULT_WAIT_MS: Final = 200
#: timeouts of the short-lived connections that ask a node for the slot map
_PROBE_TIMEOUT_S: Final = 1.0

Node = tuple[str, int]


class ClusterUrlError(ValueError):
    pass


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SCHEMES


def split_url(url: str) -> tuple[str, list[Node]]:
    """``redis+cluster://[user:pass@]h1:p1[,h2:p2...][/0][?tls options]`` -> the plain
    URL of the first seed (credentials and TLS options parse as usual) and every seed."""
    scheme, _, rest = url.partition("://")
    plain = SCHEMES.get(scheme.lower())
    if plain is None:
        raise ClusterUrlError(f"not a cluster URL: use {' or '.join(s + '://' for s in SCHEMES)}")
    netloc, sep, tail = rest.partition("/")
    if not sep:
        netloc, sep, query = netloc.partition("?")
        tail = f"?{query}" if sep else ""
    auth, at, hosts = netloc.rpartition("@")
    seeds: list[Node] = []
    for part in hosts.split(","):
        host, colon, port = part.strip().rpartition(":")
        if not colon or not host or not port.isdigit():
            raise ClusterUrlError(
                f"cluster URL seed {unquote(part)!r} is not host:port: list one or more "
                "nodes as redis+cluster://HOST:PORT[,HOST:PORT]"
            )
        seeds.append((host.strip("[]"), int(port)))
    db = tail.partition("?")[0]
    if db not in ("", "0"):
        raise ClusterUrlError(f"a Redis Cluster has database 0 only, not {db!r}: drop it")
    first = f"{seeds[0][0]}:{seeds[0][1]}"
    return f"{plain}://{auth}{at}{first}/{tail}", seeds


@dataclass(frozen=True, slots=True)
class Master:
    node: Node
    ranges: tuple[tuple[int, int], ...]
    replicas: tuple[Node, ...]

    def serves(self, slot: int) -> bool:
        return any(lo <= slot <= hi for lo, hi in self.ranges)


class Topology:
    """Which master serves which slot, asked of any live node (seeds first, then every
    node met so far). Thread-safe; each ``masters()`` asks afresh."""

    def __init__(self, seeds: Sequence[Node], node_kwargs: Mapping[str, Any]) -> None:
        if not seeds:
            raise ClusterUrlError("a cluster URL needs at least one host:port")
        self._seeds = list(seeds)
        self._known: list[Node] = []
        self._kwargs = dict(node_kwargs)
        self._lock = threading.Lock()
        self._served_by: dict[int, Node] = {}
        #: how often a pinned connection found its slot on another node than before
        self.changes = 0

    def masters(self) -> list[Master]:
        with self._lock:
            candidates = list(dict.fromkeys([*self._known, *self._seeds]))
        errors: list[str] = []
        for host, port in candidates:
            probe = redis.Redis(
                host=host,
                port=port,
                socket_timeout=_PROBE_TIMEOUT_S,
                socket_connect_timeout=_PROBE_TIMEOUT_S,
                **self._kwargs,
            )
            try:
                raw: Any = probe.execute_command("CLUSTER SLOTS")  # type: ignore[no-untyped-call]
            except redis.exceptions.RedisError as exc:
                errors.append(f"{host}:{port}: {type(exc).__name__}")
                continue
            finally:
                probe.close()
            masters = _parse_slots(raw, host)
            if masters:
                with self._lock:
                    nodes = [m.node for m in masters] + [r for m in masters for r in m.replicas]
                    self._known = list(dict.fromkeys(nodes))
                return masters
        raise redis.exceptions.ConnectionError(
            f"no cluster node answered CLUSTER SLOTS ({'; '.join(errors)[:200]})"
        )

    def master_of(self, slot: int) -> Node:
        for m in self.masters():
            if m.serves(slot):
                with self._lock:
                    if self._served_by.setdefault(slot, m.node) != m.node:
                        self._served_by[slot] = m.node
                        self.changes += 1
                return m.node
        raise redis.exceptions.ConnectionError(f"no master serves slot {slot} (cluster down?)")


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _parse_slots(raw: Any, asked: str) -> list[Master]:
    by_node: dict[Node, list[tuple[int, int]]] = {}
    replicas: dict[Node, list[Node]] = {}
    for item in raw or ():
        lo, hi, master, *reps = item
        # An empty host means "the node you asked" (cluster-announce-hostname unset).
        node = (_text(master[0]) or asked, int(master[1]))
        by_node.setdefault(node, []).append((int(lo), int(hi)))
        replicas.setdefault(node, []).extend((_text(r[0]) or asked, int(r[1])) for r in reps)
    out = [Master(n, tuple(sorted(r)), tuple(replicas[n])) for n, r in by_node.items()]
    return sorted(out, key=lambda m: m.ranges[0][0])


class _PinMixin:
    """A connection that asks the cluster where its slot lives each time it connects."""

    host: str
    port: int

    def __init__(self, *, topology: Topology, slot: int, **kwargs: Any) -> None:
        self._topology = topology
        self._slot = slot
        super().__init__(**kwargs)

    def _connect(self) -> Any:
        self.host, self.port = self._topology.master_of(self._slot)
        return super()._connect()  # type: ignore[misc]


class _PinnedConnection(_PinMixin, Connection):
    pass


class _PinnedSSLConnection(_PinMixin, SSLConnection):
    pass


def moves(client: redis.Redis) -> int:
    """How often ``client``'s slot was found on a new node (0 for a plain client)."""
    topology = client.connection_pool.connection_kwargs.get("topology")
    return topology.changes if isinstance(topology, Topology) else 0


def slot_of(key: str) -> int:
    return int(key_slot(key.encode()))


def pinned_client(
    url: str, key: str, *, common: Mapping[str, Any], tcp: Mapping[str, Any]
) -> redis.Redis:
    """A client on the master that serves ``key``'s slot (``common``/``tcp``: the
    options ``connection.connect`` gives a plain client)."""
    _, seeds = split_url(url)
    node_kwargs = {k: v for k, v in common.items() if k in ("username", "password", "protocol")} | {
        k: v for k, v in tcp.items() if k.startswith("ssl")
    }
    topology = Topology(seeds, node_kwargs)
    ssl = bool(tcp.get("ssl"))
    conn_kwargs = {k: v for k, v in {**common, **tcp}.items() if k not in ("ssl", "host", "port")}
    # Connection wants retry=None or a Retry; decode_responses etc. pass through.
    pool = redis.ConnectionPool(
        connection_class=_PinnedSSLConnection if ssl else _PinnedConnection,
        topology=topology,
        slot=slot_of(key),
        host=seeds[0][0],
        port=seeds[0][1],
        **conn_kwargs,
    )
    return redis.Redis(connection_pool=pool)


def topology_of(url: str, env: Mapping[str, str] | None = None) -> Topology:
    from flodl_bus.bus.connection import parse_url

    plain, seeds = split_url(url)
    t = parse_url(plain, env)
    return Topology(seeds, {"username": t.username, "password": t.password})


def choose_shards(masters: Sequence[Master], run: str, count: int | None = None) -> tuple[int, ...]:
    """A tag suffix ``n`` per shard whose slot (``{RUN:n}``) a distinct master serves:
    shard i goes to ``masters[i % M]``, and ``n`` is the smallest unused number whose
    CRC16 slot falls in that master's ranges (found within a few hundred tries: each
    master serves a fair share of the 16,384 slots)."""
    if not masters:
        raise ClusterUrlError("the cluster has no master with slots")
    count = len(masters) if count is None else count
    if count < 1:
        raise ClusterUrlError(f"shards must be >= 1, got {count}")
    out: list[int] = []
    for i in range(count):
        master = masters[i % len(masters)]
        n = 0
        while n in out or not master.serves(slot_of(f"{{{run}:{n}}}")):
            n += 1
            if n > 100 * REDIS_CLUSTER_HASH_SLOTS:
                raise ClusterUrlError(f"no tag of run {run!r} lands on {master.node}")
        out.append(n)
    return tuple(out)


def shards_field(shards: Sequence[int]) -> str:
    """How the run's meta carries the shard tags (``"12,7,40"``; empty on one Redis)."""
    return ",".join(str(n) for n in shards)


def parse_shards(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return tuple(int(p) for p in text.split(","))
    except ValueError:
        raise ClusterUrlError(f"the run's meta holds bad shard tags {text!r}") from None


def confirm(client: redis.Redis, fence: str, timeout_ms: int) -> int:
    """How many replicas acknowledged every write made on ``client``'s master so far
    (``WAIT 1``, at most ``timeout_ms``). WAIT counts the writes of its own connection,
    so a counter bumped on the same connection first makes it cover writes made on
    others (replication is one ordered stream per master)."""
    pipe = client.pipeline(transaction=False)
    pipe.incr(fence)
    pipe.execute_command("WAIT", 1, timeout_ms)  # type: ignore[no-untyped-call]
    return int(pipe.execute()[-1])


def plan_shards(url: str, run: str) -> tuple[int, ...]:
    """The shard tags of a new run at ``url``: one shard per master (none on one Redis)."""
    if not is_cluster_url(url):
        return ()
    return choose_shards(topology_of(url).masters(), run)


def key_owners(
    url: str, keys: RunKeys, home: redis.Redis, *, client_name: str
) -> list[tuple[redis.Redis, str]]:
    """A client and the key prefix it can SCAN for every part of the run: the run-wide
    keys on ``home``, each shard's on a client pinned to that shard (all one slot, so
    one node holds each prefix's keys)."""
    from flodl_bus.bus.connection import connect

    out = [(home, keys.prefix)]
    for i in range(len(keys.shards)):
        client = connect(url, client_name=client_name, key=keys.broadcast_of_shard(i))
        out.append((client, keys.shard_prefix(i)))
    return out


def check_layout(url: str, keys: RunKeys) -> None:
    """A rank's URL must match how its coordinator laid the run out."""
    if keys.shards and not is_cluster_url(url):
        raise ClusterUrlError(
            f"run {keys.run!r} is spread over a Redis Cluster: give the cluster's URL as "
            "redis+cluster://HOST:PORT[,HOST:PORT]"
        )
    if is_cluster_url(url) and not keys.shards:
        raise ClusterUrlError(
            f"run {keys.run!r} was started on a single Redis, not a cluster: give that "
            "Redis's redis:// URL"
        )
