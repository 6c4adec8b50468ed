"""The control plane on a Redis Cluster of 3 masters + 3 replicas started by the test
on loopback ports (``bus.cluster``, ``bus.sharded``, ``bus.replication``)."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator, Sequence

import pytest
import redis
import structlog

from flodl_bus.bus import cluster
from flodl_bus.bus.api import Delivery
from flodl_bus.bus.cluster_server import LocalCluster
from flodl_bus.bus.connection import BadRedisUrl, RedisUnreachable, connect, connect_pinged
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.sharded import ShardedCoordinatorBus
from flodl_bus.bus.streams import RedisRankBus
from flodl_bus.protocol import messages as m
from tests.bus.conftest import CK, FAST, RK

pytestmark = pytest.mark.redis

RANKS = 6


@pytest.fixture(scope="module")
def local_cluster() -> Iterator[LocalCluster]:
    with LocalCluster(masters=3, replicas=1) as c:
        yield c


def _run(local_cluster: LocalCluster, name: str) -> RunKeys:
    run = f"{name}-{random.randrange(1 << 30)}"
    return RunKeys(run, cluster.plan_shards(local_cluster.url, run))


def _buses(
    url: str, keys: RunKeys, ranks: int = RANKS, wait_ms: int = 200
) -> tuple[ShardedCoordinatorBus, list[RedisRankBus]]:
    coord = ShardedCoordinatorBus(
        [connect(url, key=b) for b in keys.broadcasts],
        keys,
        CK,
        ranks=range(ranks),
        config=FAST,
        wait_ms=wait_ms,
    )
    buses = [
        RedisRankBus(connect(url, key=keys.ctl(r)), keys, r, RK(r), config=FAST)
        for r in range(ranks)
    ]
    return coord, buses


def _steps(ds: Sequence[Delivery]) -> list[int]:
    return [d.msg.global_step for d in ds if isinstance(d.msg, m.SetGlobalStep)]


def _collect(bus: RedisRankBus, n: int, timeout: float = 30.0) -> list[Delivery]:
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while len(_steps(got)) < n and time.monotonic() < deadline:
        ds = bus.read_control(100)
        bus.ack(ds)
        got += ds
    return got


def _collect_up(coord: ShardedCoordinatorBus, n: int, timeout: float = 30.0) -> list[Delivery]:
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        ds = coord.read_upstream(100)
        coord.ack(ds)
        got += ds
    return got


def _batch(rank: int, i: int) -> m.Batch:
    return m.Batch(rank=rank, batch_ms=1.0, data_ms=0.1, step_count=i, batch_loss=0.5)


def _port(client: redis.Redis) -> int:
    conn = client.connection_pool.get_connection()
    try:
        return int(conn.port)
    finally:
        client.connection_pool.release(conn)


def test_the_shard_tags_of_a_run_land_on_three_different_masters(
    local_cluster: LocalCluster,
) -> None:
    keys = _run(local_cluster, "tags")
    masters = cluster.topology_of(local_cluster.url).masters()
    assert len(keys.shards) == 3
    owners = [
        next(i for i, mst in enumerate(masters) if mst.serves(cluster.slot_of(keys.ctl(r))))
        for r in range(3)
    ]
    assert sorted(owners) == [0, 1, 2]
    # a rank's control, its upstream and its shard's broadcast share one slot
    for r in range(RANKS):
        slots = {cluster.slot_of(k) for k in (keys.ctl(r), keys.up(r), keys.ctl_all_of(r))}
        assert len(slots) == 1
    # and the clients pinned to them talk to three different nodes
    ports = {_port(connect(local_cluster.url, key=keys.ctl(r))) for r in range(3)}
    assert len(ports) == 3


def test_order_no_loss_no_duplicate_across_shards(local_cluster: LocalCluster) -> None:
    keys = _run(local_cluster, "order")
    coord, buses = _buses(local_cluster.url, keys)
    rng = random.Random(3)
    expected: dict[int, list[int]] = {r: [] for r in range(RANKS)}
    i = 0
    try:
        for _ in range(60):
            roll = rng.random()
            if roll < 0.25:
                coord.broadcast(m.SetGlobalStep(global_step=i))
                for r in range(RANKS):
                    expected[r].append(i)
                i += 1
            elif roll < 0.5:
                batch: list[tuple[int | None, m.SetGlobalStep]] = []
                for r in rng.sample(range(RANKS), 4):
                    batch.append((r, m.SetGlobalStep(global_step=i)))
                    expected[r].append(i)
                    i += 1
                coord.send_batch(batch)
            elif roll < 0.6:
                coord.send_batch([(None, m.SetGlobalStep(global_step=i))])
                for r in range(RANKS):
                    expected[r].append(i)
                i += 1
            else:
                r = rng.randrange(RANKS)
                coord.send(r, m.SetGlobalStep(global_step=i))
                expected[r].append(i)
                i += 1
        for r, bus in enumerate(buses):
            for j in range(20):
                bus.publish(_batch(r, j))
        for r, bus in enumerate(buses):
            assert _steps(_collect(bus, len(expected[r]))) == expected[r], f"rank {r}"
        up = _collect_up(coord, RANKS * 20)
        for r in range(RANKS):
            mine = [d.msg.step_count for d in up if d.msg.rank == r]
            assert mine == list(range(20)), f"rank {r} upstream"
        # nothing more arrives: no duplicate on either side
        assert coord.read_upstream(300) == []
        assert all(bus.read_control(100) == [] for bus in buses)
        assert coord.lost == 0
    finally:
        coord.close()
        for bus in buses:
            bus.close()


def test_a_foreign_entry_on_a_shard_broadcast_stream_is_dead_lettered(
    local_cluster: LocalCluster,
) -> None:
    keys = _run(local_cluster, "foreign")
    coord, buses = _buses(local_cluster.url, keys, ranks=3)
    try:
        coord.broadcast(m.SetGlobalStep(global_step=1))
        shard1 = keys.broadcast_of_shard(keys.shard_of(1))
        admin = connect(local_cluster.url, key=shard1)
        admin.xadd(shard1, {b"type": b"Shutdown", b"rank": b"all", b"seq": b"99", b"body": b""})
        coord.broadcast(m.SetGlobalStep(global_step=2))
        for bus in buses:
            assert _steps(_collect(bus, 2)) == [1, 2]
        dlq = keys.dlq_for(shard1)
        dead = admin.xrange(dlq)
        assert len(dead) == 1 and dead[0][1][b"stream"] == shard1.encode()
        assert b"bad fields" in dead[0][1][b"reason"]
        # the other shards' dlqs stay empty: each dead letter lands beside its stream
        others = [d for d in keys.dlqs[1:] if d != dlq]
        for d in others:
            assert connect(local_cluster.url, key=d).xlen(d) == 0
    finally:
        coord.close()
        for bus in buses:
            bus.close()


def test_a_cluster_url_is_refused_in_one_line_where_no_key_is_named(
    local_cluster: LocalCluster,
) -> None:
    with pytest.raises(BadRedisUrl, match=r"Redis Cluster URL, which only .*coordinator"):
        connect(local_cluster.url)
    with pytest.raises(BadRedisUrl, match="database 0 only"):
        connect("redis+cluster://127.0.0.1:7000/3", key="k")
    with pytest.raises(BadRedisUrl, match="host:port"):
        connect("redis+cluster://127.0.0.1", key="k")


def _master_index(c: LocalCluster, client: redis.Redis) -> int:
    idx = c.master_of_port(_port(client))
    assert idx is not None
    return idx


@pytest.mark.slow
def test_the_failover_of_a_master_that_holds_ranks_loses_nothing() -> None:
    """Kill the master of rank 0's shard with traffic before and after: its replica takes
    over and every rank still gets all its control, in order, once."""
    with LocalCluster(masters=3, replicas=1) as c:
        keys = _run(c, "failover")
        coord, buses = _buses(c.url, keys, ranks=3)
        try:
            for i in range(20):
                coord.broadcast(m.SetGlobalStep(global_step=i))
                coord.send(0, m.SetGlobalStep(global_step=1000 + i))
            victim = _master_index(c, buses[0]._reader.client)
            c.nodes[victim].proc.kill()  # type: ignore[union-attr]
            c.nodes[victim].proc.wait()  # type: ignore[union-attr]
            for i in range(20, 40):
                coord.broadcast(m.SetGlobalStep(global_step=i))
                coord.send(0, m.SetGlobalStep(global_step=1000 + i))
            want0 = [s for i in range(40) for s in (i, 1000 + i)]
            assert _steps(_collect(buses[0], 80, timeout=60)) == want0
            for r in (1, 2):
                assert _steps(_collect(buses[r], 40, timeout=60)) == list(range(40))
            assert coord.lost == 0  # every entry was WAIT-confirmed before the kill
        finally:
            coord.close()
            for bus in buses:
                bus.close()


@pytest.mark.slow
def test_an_entry_a_failover_lost_is_named_and_written_again() -> None:
    """The replica is stopped and cut off, so WAIT confirms nothing; the master is killed and the
    replica resumed and promoted: the promoted replica lacks the newest entries. The
    coordinator names each one (bus_control_lost) and writes it again; the rank gets
    every message once, in order."""
    with LocalCluster(masters=3, replicas=1) as c:
        keys = _run(c, "lost")
        coord, buses = _buses(c.url, keys, ranks=3, wait_ms=50)
        try:
            coord.send(0, m.SetGlobalStep(global_step=0))
            assert _steps(_collect(buses[0], 1)) == [0]
            victim = _master_index(c, buses[0]._reader.client)
            replica = c.replica_of(victim)
            os.kill(c.nodes[replica].proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
            # and cut off: what the master writes now reaches no replica's socket
            master = c.client(victim)
            assert master.execute_command("CLIENT KILL", "TYPE", "replica") == 1
            master.close()
            with structlog.testing.capture_logs() as logs:
                coord.send(0, m.SetGlobalStep(global_step=1))
                coord.send(0, m.SetGlobalStep(global_step=2))
                assert [e["event"] for e in logs].count("bus_replication_unconfirmed") == 1
                c.nodes[victim].proc.kill()  # type: ignore[union-attr]
                c.nodes[victim].proc.wait()  # type: ignore[union-attr]
                os.kill(c.nodes[replica].proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
                coord.send(0, m.SetGlobalStep(global_step=3))
            lost = [e for e in logs if e["event"] == "bus_control_lost"]
            assert [(e["seq"], e["rewritten"]) for e in lost] == [("2", True), ("3", True)]
            assert coord.lost == 2
            got = _collect(buses[0], 3, timeout=60)
            steps = _steps(got)
            # steps 1 and 2 may have been read from the old master before it died: the
            # copies are then refused as replayed; each step is dispatched once, in order
            assert steps == [1, 2, 3]
        finally:
            coord.close()
            for bus in buses:
                bus.close()


@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("flodl_bus.bus.acl", ["create", "r1"]),
        ("flodl_bus.bus.tail", ["--run", "r1"]),
        ("flodl_bus.launch.status", ["--run", "r1"]),
    ],
)
def test_commands_that_take_a_single_redis_refuse_a_cluster_url_in_one_line(
    module: str, args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib

    main = importlib.import_module(module).main
    assert main([*args, "--redis-url", "redis+cluster://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a Redis Cluster URL, which only" in err[0]


def test_a_rank_whose_url_does_not_match_the_run_layout_is_told_the_fix() -> None:
    with pytest.raises(cluster.ClusterUrlError, match="redis\\+cluster://HOST:PORT"):
        cluster.check_layout("redis://127.0.0.1:1/0", RunKeys("r", (1, 2, 3)))
    with pytest.raises(cluster.ClusterUrlError, match="single Redis"):
        cluster.check_layout("redis+cluster://127.0.0.1:1", RunKeys("r"))
    cluster.check_layout("redis://127.0.0.1:1/0", RunKeys("r"))


def test_a_plain_url_to_a_cluster_node_is_refused_in_one_line_naming_the_cluster_url(
    local_cluster: LocalCluster,
) -> None:
    node = f"redis://127.0.0.1:{local_cluster.nodes[0].port}/0"
    with pytest.raises(RedisUnreachable, match=r"node of a Redis Cluster.*redis\+cluster://"):
        connect_pinged(node, client_name="t")
