"""``flodl-bus bench cluster``: the control plane on a Redis Cluster beside one Redis.

Starts a redis-server and a local cluster (3 masters + 3 replicas, ``bus.cluster_server``)
on loopback and runs the same bus traffic on both, in this process (the coordinator's
bus and N rank buses on their own threads). Each figure beside its single-Redis
reference from the same run:

* control dispatch latency (coordinator send -> rank reader, CLOCK_MONOTONIC), p50/p99,
  unicast and broadcast mixed, one message in flight at a time;
* coordinator send rate (unicasts, one ``send`` each): the cluster's WAIT after every
  control write is most of its cost, so it is also shown without WAIT;
* coordinator upstream ingest rate (every rank's publisher writing at once);
* the failover of the master holding rank 0's shard (``SIGKILL``): how long until a
  control write to that shard lands again, and how many entries were named lost.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from flodl_bus.bus import cluster
from flodl_bus.bus.cluster_server import LocalCluster
from flodl_bus.bus.connection import connect
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.server import RedisServer
from flodl_bus.bus.sharded import ShardedCoordinatorBus
from flodl_bus.bus.streams import RedisCoordinatorBus, RedisRankBus
from flodl_bus.protocol import messages as m
from flodl_bus.protocol.signing import fixed_keys, rank_keys_for

CK = fixed_keys()


def _buses(url: str, ranks: int, wait_ms: int) -> tuple[Any, list[RedisRankBus], RunKeys]:
    run = f"bench-{uuid.uuid4().hex[:8]}"
    keys = RunKeys(run, cluster.plan_shards(url, run))
    coord: Any
    if keys.shards:
        clients = [connect(url, key=b) for b in keys.broadcasts]
        coord = ShardedCoordinatorBus(clients, keys, CK, ranks=range(ranks), wait_ms=wait_ms)
    else:
        coord = RedisCoordinatorBus(connect(url), keys, CK, ranks=range(ranks))
    buses = [
        RedisRankBus(connect(url, key=keys.ctl(r)), keys, r, rank_keys_for(CK, r))
        for r in range(ranks)
    ]
    return coord, buses, keys


def _close(coord: Any, buses: Sequence[RedisRankBus]) -> None:
    coord.close()
    for b in buses:
        b.close()


def dispatch(url: str, ranks: int, messages: int) -> list[float]:
    coord, buses, _ = _buses(url, ranks, cluster.DEFAULT_WAIT_MS)
    lat: list[float] = []
    lock = threading.Lock()
    stop = threading.Event()

    def reader(bus: RedisRankBus) -> None:
        while not stop.is_set():
            got = bus.read_control(100)
            now = time.monotonic_ns()
            with lock:
                lat.extend((now - d.msg.global_step) / 1e6 for d in got)  # type: ignore[attr-defined]
            bus.ack(got)

    threads = [threading.Thread(target=reader, args=(b,), daemon=True) for b in buses]
    for t in threads:
        t.start()
    expected = 0
    for i in range(messages):
        msg = m.SetGlobalStep(global_step=time.monotonic_ns())
        if i % 4 == 3:
            coord.broadcast(msg)
            expected += ranks
        else:
            coord.send(i % ranks, msg)
            expected += 1
        deadline = time.monotonic() + 5
        while len(lat) < expected and time.monotonic() < deadline:
            time.sleep(0.0002)
    stop.set()
    for t in threads:
        t.join(2)
    _close(coord, buses)
    return lat


def send_rate(url: str, ranks: int, messages: int, wait_ms: int) -> float:
    coord, buses, _ = _buses(url, ranks, wait_ms)
    t0 = time.perf_counter()
    for i in range(messages):
        coord.send(i % ranks, m.SetGlobalStep(global_step=i))
    rate = messages / (time.perf_counter() - t0)
    _close(coord, buses)
    return rate


def ingest_rate(url: str, ranks: int, per_rank: int) -> float:
    coord, buses, _ = _buses(url, ranks, cluster.DEFAULT_WAIT_MS)
    t0 = time.perf_counter()
    for i in range(per_rank):
        for r, b in enumerate(buses):
            b.publish(m.Batch(rank=r, batch_ms=1.0, data_ms=0.1, step_count=i, batch_loss=0.5))
    got = 0
    deadline = time.monotonic() + 120
    while got < ranks * per_rank and time.monotonic() < deadline:
        ds = coord.read_upstream(200)
        coord.ack(ds)
        got += len(ds)
    rate = got / (time.perf_counter() - t0)
    _close(coord, buses)
    return rate


def failover(local: LocalCluster, ranks: int) -> tuple[float, int]:
    """Seconds from the kill of rank 0's master to the next control write landing, and
    the control entries named lost."""
    coord, buses, _ = _buses(local.url, ranks, cluster.DEFAULT_WAIT_MS)
    coord.send(0, m.SetGlobalStep(global_step=0))
    port = buses[0]._reader.client.connection_pool.get_connection().port
    victim = local.master_of_port(int(port))
    proc = local.nodes[victim].proc if victim is not None else None
    assert proc is not None
    t0 = time.monotonic()
    proc.kill()
    coord.send(0, m.SetGlobalStep(global_step=1))
    took = time.monotonic() - t0
    lost = int(coord.lost)
    _close(coord, buses)
    return took, lost


def _q(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def _row(name: str, single: float, clustered: float, unit: str, fmt: str = ".3f") -> str:
    ratio = clustered / single if single else float("nan")
    return f"  {name:<34} {clustered:{fmt}} {unit:<6} (one Redis {single:{fmt}}, x{ratio:.2f})"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="flodl-bus bench cluster", description=__doc__)
    ap.add_argument("--ranks", type=int, default=6)
    ap.add_argument("--messages", type=int, default=400)
    ap.add_argument("--upstream", type=int, default=2000, help="messages per rank")
    ap.add_argument("--no-failover", action="store_true")
    args = ap.parse_args(argv)
    single = RedisServer().start()
    local = LocalCluster(masters=3, replicas=1).start()
    try:
        runs: list[tuple[str, Callable[[str], Any]]] = [
            ("dispatch", lambda u: dispatch(u, args.ranks, args.messages)),
            ("send", lambda u: send_rate(u, args.ranks, args.messages, cluster.DEFAULT_WAIT_MS)),
            ("send_nowait", lambda u: send_rate(u, args.ranks, args.messages, 0)),
            ("ingest", lambda u: ingest_rate(u, args.ranks, args.upstream)),
        ]
        res: dict[str, tuple[Any, Any]] = {}
        for name, fn in runs:
            res[name] = (fn(single.url), fn(local.url))
        d1, d2 = res["dispatch"]
        print(f"bench cluster: {args.ranks} ranks, 3 masters + 3 replicas vs one redis-server")
        print(_row("dispatch p50", statistics.median(d1), statistics.median(d2), "ms"))
        print(_row("dispatch p99", _q(d1, 0.99), _q(d2, 0.99), "ms"))
        print(_row("send rate (WAIT 1 after each)", *res["send"], "msg/s", ".0f"))
        print(_row("send rate (no WAIT)", *res["send_nowait"], "msg/s", ".0f"))
        print(_row("upstream ingest", *res["ingest"], "msg/s", ".0f"))
        if not args.no_failover:
            took, lost = failover(local, args.ranks)
            print(
                f"  failover (SIGKILL of rank 0's master, node timeout "
                f"{local.node_timeout_ms} ms): next control write landed after "
                f"{took:.2f} s, {lost} entries named lost"
            )
    finally:
        local.cleanup()
        single.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
