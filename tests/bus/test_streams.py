"""The Redis Streams transport against fakeredis and a real redis-server (DESIGN §3)."""

from __future__ import annotations

import random
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

import pytest
import redis
import structlog

from flodl_bus.bus import entries
from flodl_bus.bus.api import Delivery
from flodl_bus.bus.connection import connect
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.server import RedisServer
from flodl_bus.bus.stream_ops import BusError, StreamsConfig
from flodl_bus.bus.streams import RedisCoordinatorBus, RedisRankBus
from flodl_bus.protocol import messages as m
from flodl_bus.protocol.signing import fixed_keys, signed_bytes
from tests.bus.conftest import CK, FAST, RK, Backend
from tests.bus.faults import Faults, lossy_client


def _steps(ds: Sequence[Delivery]) -> list[int]:
    return [d.msg.global_step for d in ds if isinstance(d.msg, m.SetGlobalStep)]


def collect(bus: RedisRankBus, n: int, timeout: float = 20.0) -> list[Delivery]:
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        ds = bus.read_control(100)
        bus.ack(ds)
        got += ds
    return got


def collect_up(coord: RedisCoordinatorBus, n: int, timeout: float = 20.0) -> list[Delivery]:
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        ds = coord.read_upstream(100)
        coord.ack(ds)
        got += ds
    return got


def _lossy(backend: Backend, faults: Faults) -> redis.Redis:
    """A client of ``backend`` whose replies ``faults`` drops."""
    if backend.fake_server is not None:
        return lossy_client(faults, server=backend.fake_server)
    return lossy_client(faults, url=backend.url)


def _batch(rank: int, i: int) -> m.Batch:
    return m.Batch(rank=rank, batch_ms=1.0, data_ms=0.1, step_count=i, batch_loss=0.5)


def _run_traffic(
    make: object,
    run: str,
    ranks: int,
    control: int,
    upstream: int,
    disturb: object,
    config: StreamsConfig = FAST,
    pace: float = 0.0,
) -> None:
    """Control and upstream traffic in threads while ``disturb()`` runs; assert that
    every rank saw exactly its control messages in send order, and the coordinator
    every rank's upstream messages exactly once, in order."""
    assert callable(make) and callable(disturb)
    coord = RedisCoordinatorBus(make(), run, CK, ranks=range(ranks), config=config)
    buses = [RedisRankBus(make(), run, r, RK(r), config=config) for r in range(ranks)]
    rng = random.Random(7)
    expected: dict[int, list[int]] = {r: [] for r in range(ranks)}
    plan = []
    for i in range(control):
        if rng.random() < 0.3:
            plan.append((None, i))
            for r in range(ranks):
                expected[r].append(i)
        else:
            r = rng.randrange(ranks)
            plan.append((r, i))
            expected[r].append(i)
    got: dict[int, list[Delivery]] = {}
    up_got: list[Delivery] = []

    def send() -> None:
        for target, i in plan:
            msg = m.SetGlobalStep(global_step=i)
            if target is None:
                coord.broadcast(msg)
            else:
                coord.send(target, msg)
            if pace:
                time.sleep(pace)
            elif i % 50 == 0:
                time.sleep(0.002)

    def rank_loop(r: int) -> None:
        for i in range(upstream):
            buses[r].publish(_batch(r, i))
            if pace:
                time.sleep(pace * 2)
        got[r] = collect(buses[r], len(expected[r]), timeout=60)

    def coord_loop() -> None:
        up_got.extend(collect_up(coord, ranks * upstream, timeout=60))

    threads = [threading.Thread(target=send), threading.Thread(target=coord_loop)]
    threads += [threading.Thread(target=rank_loop, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    disturb()
    for t in threads:
        t.join(90)
    try:
        for r in range(ranks):
            assert _steps(got[r]) == expected[r], f"rank {r}"
        per_rank: dict[int, list[int]] = {r: [] for r in range(ranks)}
        for d in up_got:
            assert isinstance(d.msg, m.Batch)
            per_rank[d.msg.rank].append(d.msg.step_count)
        for r in range(ranks):
            assert per_rank[r] == list(range(upstream)), f"upstream of rank {r}"
        # Nothing more arrives later (no duplicate hiding behind the counts).
        for b in buses:
            assert b.read_control(50) == []
        assert coord.read_upstream(50) == []
    finally:
        for b in buses:
            b.close()
        coord.close()


# ------------------------------------------------------------------------- order


def test_eight_ranks_dispatch_interleaved_unicast_and_broadcast_in_send_order(
    backend: Backend,
) -> None:
    # A small COUNT makes single reads cut one stream short, which is when a naive
    # merge would overtake.
    config = StreamsConfig(read_count=5, backoff=FAST.backoff)
    _run_traffic(backend.make, "order", 8, 400, 20, lambda: None, config)


def test_one_upstream_read_is_bounded_over_all_streams_reaches_every_rank_and_says_it_is_behind(
    backend: Backend,
) -> None:
    # 4,096 ranks' streams read at 512 each gave one read of 110,000 entries and a pass
    # of 30 s without a tick: every rank dispatched early in it was declared dead.
    config = StreamsConfig(read_count=512, read_total=24, backoff=FAST.backoff)
    keys = RunKeys("bounded")
    ranks = list(range(10))
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=ranks[:4], config=config)
    for r in ranks[4:]:
        coord.add_rank(r)  # the COUNT follows the streams as they are added
    buses = [RedisRankBus(backend.make(), keys, r, RK(r), config=FAST) for r in ranks]
    for bus in buses:
        for i in range(7):
            bus.publish(_batch(bus.rank, i))
        assert bus.flush(10)
    got: list[Delivery] = []
    deadline = time.monotonic() + 20
    while len(got) < 70:
        assert time.monotonic() < deadline, f"{70 - len(got)} entries left unread"
        batch = coord.read_upstream(100)
        if not batch:
            continue  # the first read only drains what was pending
        assert len(batch) <= 24
        # every rank with entries left is reached by every read: none waits a pass out
        left = {r for r in ranks if sum(d.msg.rank == r for d in got) < 7}
        assert {d.msg.rank for d in batch} == left
        coord.ack(batch)
        got += batch
        if len(got) < 70:
            # a read that left entries says so: a rank not reached is not a silent one
            assert coord.behind
    for r in ranks:
        assert [d.msg.step_count for d in got if d.msg.rank == r] == list(range(7))
    assert coord.read_upstream(0) == []
    assert not coord.behind
    for bus in buses:
        bus.close()
    coord.close()


# ------------------------------------------------------------------------ faults


def test_killed_connections_mid_stream_lose_nothing_and_duplicate_nothing(
    backend: Backend,
) -> None:
    def kill_repeatedly() -> None:
        for _ in range(6):
            time.sleep(0.05)
            backend.kill_connections()

    with structlog.testing.capture_logs() as logs:
        _run_traffic(backend.make, "kill", 3, 500, 150, kill_repeatedly, pace=0.001)
    assert any(e["event"] == "redis_reconnected" for e in logs)


@pytest.mark.redis
def test_streams_continue_across_a_redis_restart_with_aof() -> None:
    with RedisServer(appendonly=True) as server:

        def restart() -> None:
            time.sleep(0.15)
            server.restart()

        with structlog.testing.capture_logs() as logs:
            _run_traffic(lambda: connect(server.url), "restart", 3, 500, 150, restart, pace=0.001)
        reconnects = [e for e in logs if e["event"] == "redis_reconnected"]
        assert reconnects, "the restart was not noticed"
        # Exactly one line per link that lost its connection, not one per attempt.
        assert len(reconnects) == len({e["link"] for e in reconnects})


def test_producer_retry_after_a_lost_xadd_reply_creates_no_duplicate(backend: Backend) -> None:
    faults = Faults("XADD", times=2)
    lossy = _lossy(backend, faults)
    keys = RunKeys("lost")
    coord = RedisCoordinatorBus(lossy, keys, CK, ranks=[0], config=FAST)
    rank = RedisRankBus(backend.make(), keys, 0, RK(0), config=FAST)
    for i in range(5):
        coord.send(0, m.SetGlobalStep(global_step=i))
    assert faults.lost == 2
    assert backend.admin.xlen(keys.ctl(0)) == 5
    assert _steps(collect(rank, 5)) == [0, 1, 2, 3, 4]

    # The same XADD re-issued by hand (what redis-py's own retry would send): refused.
    first = backend.admin.xrange(keys.ctl(0), count=1)[0]
    with pytest.raises(redis.exceptions.ResponseError, match="equal or smaller"):
        backend.admin.xadd(keys.ctl(0), first[1], id=first[0])
    assert backend.admin.xlen(keys.ctl(0)) == 5
    rank.close()
    coord.close()


def test_publisher_retry_after_a_lost_pipeline_reply_creates_no_duplicate(
    backend: Backend,
) -> None:
    faults = Faults("XADD", times=1)
    lossy = _lossy(backend, faults)
    keys = RunKeys("lostup")
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=[0], config=FAST)
    rank = RedisRankBus(lossy, keys, 0, RK(0), config=FAST)
    for i in range(200):
        rank.publish(_batch(0, i))
    assert rank.flush(10)
    assert faults.lost == 1
    assert backend.admin.xlen(keys.up(0)) == 200
    got = collect_up(coord, 200)
    assert [d.msg.step_count for d in got] == list(range(200))  # type: ignore[attr-defined]
    rank.close()
    coord.close()


def test_a_lost_xread_reply_is_read_again_from_the_cursor(backend: Backend) -> None:
    faults = Faults("XREAD", times=0)
    lossy = _lossy(backend, faults)
    keys = RunKeys("lostread")
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=[0], config=FAST)
    rank = RedisRankBus(lossy, keys, 0, RK(0), config=FAST)
    assert rank.read_control(0) == []
    for i in range(6):
        coord.send(0, m.SetGlobalStep(global_step=i))
    faults.times = 1  # the next read's reply never arrives
    got = collect(rank, 6)
    assert faults.lost == 1
    assert _steps(got) == list(range(6))
    assert rank.read_control(50) == []
    rank.close()
    coord.close()


def test_another_reader_of_a_ranks_streams_takes_nothing_from_it(backend: Backend) -> None:
    """A rank reads its control with XREAD from its own cursor: a second reader of the
    same streams, or a consumer group made by anyone who may, consumes nothing of it
    (issue 28: one StartEpoch taken from the rank's group hung a run for good)."""
    keys = RunKeys("pending")
    config = StreamsConfig(read_count=3, backoff=FAST.backoff)
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=[0], config=config)
    rank = RedisRankBus(backend.make(), keys, 0, RK(0), config=config)
    admin = backend.admin
    # groups made ahead, one far beyond every id: nothing the rank reads goes through them
    admin.xgroup_create(keys.ctl(0), "rank0", id="0", mkstream=True)
    admin.xgroup_create(keys.ctl_all, "rank0", id="99999999999999-0", mkstream=True)
    for i in range(10):
        (coord.broadcast if i % 3 == 0 else lambda msg: coord.send(0, msg))(
            m.SetGlobalStep(global_step=i)
        )
    # a thief drains the group of every entry, acks it, and reads along with XREAD
    admin.xreadgroup("rank0", "thief", {keys.ctl(0): ">"}, count=100)
    thief = RedisRankBus(backend.make(), keys, 0, RK(0), config=config)
    assert _steps(collect(thief, 10)) == list(range(10))
    got = collect(rank, 10)
    assert _steps(got) == list(range(10))
    rank.ack(got)
    # what the rank took over is what its heartbeats tell the coordinator
    ctl, bcast = rank.control_read()
    assert ctl == next(d.entry_id for d in reversed(got) if d.stream == keys.ctl(0))
    assert bcast == next(d.entry_id for d in reversed(got) if d.stream == keys.ctl_all)
    assert rank.read_control(50) == []
    for bus in (rank, thief, coord):
        bus.close()


# ------------------------------------------------------------------- bad entries


def _resp(*args: bytes) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def _malformed(keys: RunKeys, n: int, base_ms: int) -> list[tuple[str, dict[bytes, bytes], str]]:
    """``n`` bad entries for ``ctl:0`` (id, fields) with the reason each must be
    rejected for. Those signed with the right key are signed for the id they get, with
    a seq above the run's, so only their flaw can refuse them."""
    import msgpack

    stream = keys.ctl(0)
    good = entries.build(CK.rank(0), stream, "0-1", m.SetGlobalStep(global_step=1), "0", 10**6)
    Make = Callable[[str], dict[bytes, bytes]]

    def signed(type_: bytes, body: bytes, rank: bytes = b"0") -> Make:
        def make(eid: str) -> dict[bytes, bytes]:
            seq = b"1000000"
            mac = CK.rank(0).sign(
                signed_bytes(stream.encode(), eid.encode(), type_, rank, seq, body)
            )
            return {b"type": type_, b"rank": rank, b"seq": seq, b"body": body, b"mac": mac}

        return make

    def plain(fields: dict[bytes, bytes]) -> Make:
        return lambda eid: fields

    kinds: list[tuple[Make, str]] = [
        (signed(b"SetGlobalStep", b"\xc1\xff not msgpack"), "undecodable"),
        (plain({b"type": b"SyncNow", b"body": b"x"}), "bad fields"),
        (plain({**good, b"extra": b"1"}), "bad fields"),
        (plain({**good, b"mac": b"0" * 32}), "authentication failed"),
        (signed(b"Frobnicate", msgpack.packb({"v": 1, "type": "Frobnicate"})), "unknown type"),
        (signed(b"Batch", good[b"body"]), "wrong channel"),
        (signed(b"SyncNow", good[b"body"]), "type field"),
        (signed(b"SetGlobalStep", good[b"body"], rank=b"3"), "rank field"),
        (
            signed(b"SetGlobalStep", msgpack.packb({"v": 9, "type": "SetGlobalStep"})),
            "undecodable",
        ),
        (
            signed(
                b"SetGlobalStep",
                msgpack.packb({"v": 1, "type": "SetGlobalStep", "global_step": -4}),
            ),
            "undecodable",
        ),
    ]
    plan = [kinds[i % len(kinds)] for i in range(n - 1)]
    plan.append((signed(b"SetGlobalStep", b"\x00" * (entries.MAX_BODY_BYTES + 1)), "oversized"))
    out = []
    for i, (make, why) in enumerate(plan):
        eid = f"{base_ms}-{i}"
        out.append((eid, make(eid), why))
    return out


def test_a_thousand_malformed_entries_go_to_the_dlq_and_valid_traffic_flows(
    backend: Backend,
) -> None:
    keys = RunKeys("malformed")
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=[0], config=FAST)
    rank = RedisRankBus(backend.make(), keys, 0, RK(0), config=FAST)
    for i in range(10):
        coord.send(0, m.SetGlobalStep(global_step=i))
    bad = _malformed(keys, 1000, int(time.time() * 1000) + 1000)
    if backend.real:
        # Raw entries written by redis-cli, as a person or a foreign tool would.
        script = b"".join(
            _resp(b"XADD", keys.ctl(0).encode(), eid.encode(), *[x for kv in f.items() for x in kv])
            for eid, f, _ in bad
        )
        assert backend.url is not None
        done = subprocess.run(
            ["redis-cli", "-u", backend.url, "--pipe"], input=script, capture_output=True
        )
        assert done.returncode == 0, done.stderr
    else:
        for eid, f, _ in bad:
            backend.admin.xadd(keys.ctl(0), f, id=eid)  # type: ignore[arg-type]
    for i in range(10, 20):
        (coord.broadcast if i % 2 else lambda msg: coord.send(0, msg))(
            m.SetGlobalStep(global_step=i)
        )
    with structlog.testing.capture_logs() as logs:
        got = collect(rank, 20)
    assert _steps(got) == list(range(20))
    assert backend.admin.xlen(keys.dlq) == 1000
    dead = backend.admin.xrange(keys.dlq)
    for (_, fields), (_, _, why) in zip(dead, bad):
        assert fields[b"stream"] == keys.ctl(0).encode()
        assert why in fields[b"reason"].decode(), (why, fields[b"reason"])
    assert sum(e["event"] == "bus_dead_letter" and e["log_level"] == "error" for e in logs) == 1000
    assert rank.read_control(50) == []  # each bad one read past once, never again
    assert backend.admin.xlen(keys.dlq) == 1000
    rank.close()
    coord.close()


def test_forged_foreign_run_and_moved_entries_are_rejected(backend: Backend) -> None:
    a = RunKeys("runa")
    b = RunKeys("runb")
    coord_a = RedisCoordinatorBus(backend.make(), a, CK, ranks=[0, 1], config=FAST)
    rank_a = RedisRankBus(backend.make(), a, 0, RK(0), config=FAST)
    other = fixed_keys(bytes(32))
    coord_b = RedisCoordinatorBus(backend.make(), b, other, ranks=[0], config=FAST)
    coord_b.send(0, m.Shutdown())
    same_secret_b = RedisCoordinatorBus(backend.make(), "runc", CK, ranks=[0], config=FAST)
    same_secret_b.send(0, m.Shutdown())
    coord_a.send(1, m.Shutdown())
    admin = backend.admin
    msg = m.Shutdown()
    injected = [
        entries.build(other.rank(0), a.ctl(0), "0-0", msg, "0", 1),  # forged: wrong key
        admin.xrange(b.ctl(0))[0][1],  # another run's entry, copied
        admin.xrange(RunKeys("runc").ctl(0))[0][1],  # another run, same secret
        admin.xrange(a.ctl(1))[0][1],  # rank 1's entry moved into rank 0's stream
    ]
    for f in injected:
        admin.xadd(a.ctl(0), f)
    forged_up = entries.build(other.rank(0), a.up(0), "0-0", _batch(0, 1), "0", 1)
    admin.xadd(a.up(0), forged_up)  # type: ignore[arg-type]
    coord_a.send(0, m.SetGlobalStep(global_step=42))
    got = collect(rank_a, 1)
    assert _steps(got) == [42]
    assert collect_up(coord_a, 1, timeout=0.5) == []
    reasons = [f[b"reason"].decode() for _, f in admin.xrange(a.dlq)]
    assert len(reasons) == 5
    assert all(r.startswith("authentication failed") for r in reasons)
    for bus in (rank_a, coord_a, coord_b, same_secret_b):
        bus.close()


def test_a_dlq_that_cannot_be_written_never_costs_the_valid_entries_of_the_read(
    backend: Backend,
) -> None:
    keys = RunKeys("dlqfail")
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=[0], config=FAST)
    rank = RedisRankBus(backend.make(), keys, 0, RK(0), config=FAST)
    admin = backend.admin
    admin.set(keys.dlq, "not a stream")  # every XADD to the dlq now fails (WRONGTYPE)
    forged = entries.build(fixed_keys(bytes(32)).rank(0), keys.ctl(0), "0-0", m.Shutdown(), "0", 1)
    admin.xadd(keys.ctl(0), forged)  # type: ignore[arg-type]
    coord.send(0, m.SetGlobalStep(global_step=7))
    assert _steps(collect(rank, 1)) == [7]
    rank.close()
    coord.close()


def test_a_publisher_that_fails_is_reported_not_silently_dead(backend: Backend) -> None:
    keys = RunKeys("pubfail")
    backend.admin.set(keys.up(0), "not a stream")  # the publisher's first XINFO fails
    rank = RedisRankBus(backend.make(), keys, 0, RK(0), config=FAST)
    deadline = time.monotonic() + 10
    while rank.flush(0.2) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not rank.flush(0.5)
    with pytest.raises(BusError, match="publisher of rank 0 failed"):
        rank.publish(_batch(0, 1))
    rank.close()


# ---------------------------------------------------------------------- plumbing


def test_publish_returns_at_once_while_redis_is_down(backend: Backend) -> None:
    if backend.fake_server is None:
        pytest.skip("needs a server that can be made unreachable on demand")
    keys = RunKeys("down")
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=[0], config=FAST)
    rank = RedisRankBus(backend.make(), keys, 0, RK(0), config=FAST)
    assert rank.flush(5)
    backend.fake_server.connected = False
    t0 = time.perf_counter()
    for i in range(100):
        rank.publish(_batch(0, i))
    assert time.perf_counter() - t0 < 0.5
    assert not rank.flush(0.2)
    backend.fake_server.connected = True
    assert rank.flush(10)
    assert [d.msg.step_count for d in collect_up(coord, 100)] == list(range(100))  # type: ignore[attr-defined]
    rank.close()
    coord.close()


def test_publish_and_send_refuse_messages_of_the_wrong_direction(backend: Backend) -> None:
    coord = RedisCoordinatorBus(backend.make(), "dirs", CK, ranks=[0], config=FAST)
    rank = RedisRankBus(backend.make(), "dirs", 0, RK(0), config=FAST)
    with pytest.raises(TypeError):
        rank.publish(m.SyncNow())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        coord.send(0, _batch(0, 1))  # type: ignore[arg-type]
    rank.close()
    coord.close()


def test_a_restarted_coordinator_continues_ids_above_the_last_ones(backend: Backend) -> None:
    keys = RunKeys("coordrestart")
    rank = RedisRankBus(backend.make(), keys, 0, RK(0), config=FAST)
    first = RedisCoordinatorBus(backend.make(), keys, CK, ranks=[0], config=FAST)
    # An earlier incarnation whose clock ran far ahead left a high id behind.
    far_id = f"{int(time.time() * 1000) + 3_600_000}-0"
    far = entries.build(CK.rank(0), keys.ctl(0), far_id, m.SetGlobalStep(global_step=0), "0", 1)
    backend.admin.xadd(keys.ctl(0), far, id=far_id)  # type: ignore[arg-type]
    first.close()
    second = RedisCoordinatorBus(backend.make(), keys, CK, ranks=[0], config=FAST)
    for i in range(1, 4):
        second.send(0, m.SetGlobalStep(global_step=i))
    second.broadcast(m.SetGlobalStep(global_step=4))
    assert _steps(collect(rank, 5)) == [0, 1, 2, 3, 4]
    rank.close()
    second.close()


def test_streams_are_trimmed_to_about_maxlen(backend: Backend) -> None:
    config = StreamsConfig(maxlen=100, backoff=FAST.backoff)
    keys = RunKeys("trim")
    rank = RedisRankBus(backend.make(), keys, 0, RK(0), config=config)
    for i in range(2000):
        rank.publish(_batch(0, i))
    assert rank.flush(20)
    # `MAXLEN ~` trims whole radix-tree nodes (100 entries by default): near, not exact.
    assert 100 <= backend.admin.xlen(keys.up(0)) < 400
    rank.close()


def test_order_holds_when_a_read_is_cut_short_by_count(backend: Backend) -> None:
    # Everything is written before the rank reads, so every read fills COUNT on one
    # stream while the other stream already holds later ids.
    config = StreamsConfig(read_count=4, backoff=FAST.backoff)
    coord = RedisCoordinatorBus(backend.make(), "cut", CK, ranks=[0], config=config)
    rank = RedisRankBus(backend.make(), "cut", 0, RK(0), config=config)
    rng = random.Random(11)
    for i in range(200):
        msg = m.SetGlobalStep(global_step=i)
        coord.broadcast(msg) if rng.random() < 0.5 else coord.send(0, msg)
    assert _steps(collect(rank, 200)) == list(range(200))
    rank.close()
    coord.close()


def test_a_resp3_client_reads_the_same_entries_as_a_resp2_one(backend: Backend) -> None:
    import fakeredis

    def resp3() -> redis.Redis:
        if backend.fake_server is not None:
            return fakeredis.FakeRedis(server=backend.fake_server, protocol=3)
        assert backend.url is not None
        return redis.Redis.from_url(backend.url, protocol=3)

    keys = RunKeys("resp3")
    coord = RedisCoordinatorBus(resp3(), keys, CK, ranks=[0, 1], config=FAST)
    ranks = [RedisRankBus(resp3(), keys, r, RK(r), config=FAST) for r in (0, 1)]
    coord.send(1, m.SetGlobalStep(global_step=1))
    coord.broadcast(m.SetGlobalStep(global_step=2))
    assert [_steps(collect(ranks[r], n)) for r, n in ((0, 1), (1, 2))] == [[2], [1, 2]]
    for r in (0, 1):
        ranks[r].publish(_batch(r, 7))
        assert ranks[r].flush(5)
    got = [d.msg for d in collect_up(coord, 2) if isinstance(d.msg, m.Batch)]
    assert sorted((b.rank, b.step_count) for b in got) == [(0, 7), (1, 7)]
    for bus in (*ranks, coord):
        bus.close()


# ------------------------------------------------------------------- send_batch


def _batch_plan(ranks: int, n: int, seed: int) -> tuple[list[list[tuple[int | None, int]]], dict]:
    """Batches of (target, i): unicasts to random ranks and broadcasts, numbered in order."""
    rng = random.Random(seed)
    batches: list[list[tuple[int | None, int]]] = []
    expected: dict[int, list[int]] = {r: [] for r in range(ranks)}
    i = 0
    while i < n:
        batch: list[tuple[int | None, int]] = []
        broadcasts = rng.random() < 0.2  # a batch is all unicasts or all broadcasts
        for _ in range(rng.randint(1, 3) if broadcasts else rng.randint(1, 12)):
            target = None if broadcasts else rng.randrange(ranks)
            batch.append((target, i))
            for r in range(ranks) if target is None else (target,):
                expected[r].append(i)
            i += 1
        batches.append(batch)
    return batches, expected


def _send_batches(
    coord: RedisCoordinatorBus, batches: list[list[tuple[int | None, int]]], pace: float = 0.0
) -> None:
    for batch in batches:
        ids = coord.send_batch([(t, m.SetGlobalStep(global_step=i)) for t, i in batch])
        assert len(ids) == len(batch)
        if pace:
            time.sleep(pace)


def test_send_batch_keeps_each_ranks_order_across_unicast_and_broadcast(
    backend: Backend,
) -> None:
    keys = RunKeys("batch")
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=range(4), config=FAST)
    buses = [RedisRankBus(backend.make(), keys, r, RK(r), config=FAST) for r in range(4)]
    batches, expected = _batch_plan(4, 300, seed=3)
    # interleaved with single sends: one clock, one seq per stream for both paths
    coord.send(2, m.SetGlobalStep(global_step=20_000))
    _send_batches(coord, batches)
    coord.broadcast(m.SetGlobalStep(global_step=10_000))
    try:
        for r in range(4):
            want = ([20_000] if r == 2 else []) + expected[r] + [10_000]
            assert _steps(collect(buses[r], len(want))) == want, f"rank {r}"
            assert buses[r].read_control(50) == []
    finally:
        for b in buses:
            b.close()
        coord.close()


@pytest.mark.parametrize("command", ["EXEC", "WATCH", "XINFO", "EVALSHA"])
def test_send_batch_after_lost_replies_loses_and_duplicates_nothing(
    backend: Backend, command: str
) -> None:
    # A lost EXEC reply: the transaction ran, the retry must see it and not write again.
    # A lost WATCH/XINFO reply: nothing ran yet, the retry must write it once.
    # A lost EVALSHA reply (the one-round-trip script, ``bus.batch_script``): it ran.
    script = command == "EVALSHA"
    if script and not backend.real:
        pytest.skip("fakeredis runs no scripts: its buses keep the transaction")
    faults = Faults(command, times=4)
    keys = RunKeys(f"batchlost{command.lower()}")
    coord = RedisCoordinatorBus(
        _lossy(backend, faults), keys, CK, ranks=range(3), config=FAST, script=script
    )
    buses = [RedisRankBus(backend.make(), keys, r, RK(r), config=FAST) for r in range(3)]
    batches, expected = _batch_plan(3, 60, seed=5)
    _send_batches(coord, batches)
    try:
        assert faults.lost == 4
        total = sum(len(b) for b in batches)
        stored = sum(backend.admin.xlen(keys.ctl(r)) for r in range(3))
        assert stored + backend.admin.xlen(keys.ctl_all) == total
        for r in range(3):
            assert _steps(collect(buses[r], len(expected[r]))) == expected[r], f"rank {r}"
            assert buses[r].read_control(50) == []
    finally:
        for b in buses:
            b.close()
        coord.close()


def test_send_batch_under_killed_connections_loses_and_duplicates_nothing(
    backend: Backend,
) -> None:
    keys = RunKeys("batchkill")
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=range(3), config=FAST)
    buses = [RedisRankBus(backend.make(), keys, r, RK(r), config=FAST) for r in range(3)]
    batches, expected = _batch_plan(3, 3000, seed=9)
    sender = threading.Thread(target=_send_batches, args=(coord, batches))
    with structlog.testing.capture_logs() as logs:
        sender.start()
        # Kill until the sender's link has noticed a kill mid-command (a connection
        # killed while idle in the pool is replaced without a word).
        while sender.is_alive() and not any(e["event"] == "redis_reconnected" for e in logs):
            backend.kill_connections()
            time.sleep(0.005)
        sender.join(60)
    assert not sender.is_alive()
    assert any(e["event"] == "redis_reconnected" for e in logs)
    try:
        for r in range(3):
            assert _steps(collect(buses[r], len(expected[r]), timeout=60)) == expected[r]
            assert buses[r].read_control(50) == []
    finally:
        for b in buses:
            b.close()
        coord.close()


def test_send_batch_lifts_its_ids_above_a_stream_top_written_by_another_writer(
    backend: Backend,
) -> None:
    # An earlier coordinator of the run wrote ahead of this one's clock: the batch
    # follows the top instead of being refused halfway.
    keys = RunKeys("batchtop")
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=range(2), config=FAST)
    rank = RedisRankBus(backend.make(), keys, 1, RK(1), config=FAST)
    ahead = coord.client.time()[0] * 1000 + 500  # ms ahead of now, within the follow limit
    other = RedisCoordinatorBus(backend.make(), keys, CK, ranks=range(2), config=FAST)
    other._clock.raise_floor((ahead, 0))
    other.send(1, m.SetGlobalStep(global_step=0))
    other.close()
    coord._seqs.clear()  # continue above the other coordinator's seq, as a new one would
    ids = coord.send_batch([(1, m.SetGlobalStep(global_step=i)) for i in range(1, 6)])
    try:
        assert all(int(e.split("-")[0]) >= ahead for e in ids)
        assert _steps(collect(rank, 6)) == [0, 1, 2, 3, 4, 5]
    finally:
        rank.close()
        coord.close()


def test_send_batch_refuses_unicasts_and_broadcasts_in_one_batch(backend: Backend) -> None:
    # A rank blocked on both of its streams is handed only the first one signalled: a
    # mixed transaction could show it a later id before an earlier one.
    keys = RunKeys("batchmixed")
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=range(2), config=FAST)
    step = m.SetGlobalStep(global_step=1)
    with pytest.raises(ValueError, match="separate batches"):
        coord.send_batch([(None, step), (0, step)])
    assert backend.admin.exists(keys.ctl_all) == 0 or backend.admin.xlen(keys.ctl_all) == 0
    assert backend.admin.xlen(keys.ctl(0)) == 0
    coord.close()


def test_control_sent_while_a_rank_set_up_is_owed_from_when_it_started_to_read(
    backend: Backend,
) -> None:
    # A rank heartbeats while it builds its model and joins the default group, before
    # its reader runs (``worker.runtime.heartbeats_meanwhile``): those heartbeats say
    # nothing about reading, and what was sent meanwhile is owed only from the first
    # heartbeat that does; a rank that then never reads is still named, a budget later.
    keys = RunKeys("owedsetup")
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=[0], config=FAST)
    clock = [1000.0]
    coord.monotonic = lambda: clock[0]
    rank = RedisRankBus(backend.make(), keys, 0, RK(0), config=FAST)

    def beat(step: int, **read: str | None) -> None:
        rank.publish(m.Heartbeat(rank=0, step_count=step, **read))
        assert rank.flush(10)
        (got,) = collect_up(coord, 1)
        assert got.msg.step_count == step

    coord.broadcast(m.CoordHeartbeat())
    for step in (1, 2, 3):  # 45 s of setup, heartbeating without read positions
        clock[0] += 15.0
        beat(step)
        assert coord.overdue(30.0) == []
    beat(4, ctl_read="0-0", all_read="0-0")  # the runtime started: nothing read yet
    assert coord.overdue(30.0) == []  # the broadcast is 45 s old, but owed for 0 s
    clock[0] += 31.0
    beat(5, ctl_read="0-0", all_read="0-0")  # reading for 31 s, still not the broadcast
    assert [(r, what, age) for r, what, age in coord.overdue(30.0)] == [(0, "CoordHeartbeat", 31.0)]
    for bus in (rank, coord):
        bus.close()


def test_control_a_rank_leaves_unread_past_the_budget_is_named_with_its_age(
    backend: Backend,
) -> None:
    keys = RunKeys("owed")
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=[0, 1], config=FAST)
    clock = [1000.0]
    coord.monotonic = lambda: clock[0]  # sends and reports dated on a clock of ours
    ranks = [RedisRankBus(backend.make(), keys, r, RK(r), config=FAST) for r in (0, 1)]

    def beat(step: int, reads: dict[int, int]) -> None:
        """Each rank reads what ``reads`` says and heartbeats where it stands."""
        for r, bus in enumerate(ranks):
            if reads.get(r):
                bus.ack(collect(bus, reads[r]))
            ctl, bcast = bus.control_read()
            bus.publish(m.Heartbeat(rank=r, step_count=step, ctl_read=ctl, all_read=bcast))
            assert bus.flush(10)
        assert len([d for d in collect_up(coord, 2) if isinstance(d.msg, m.Heartbeat)]) == 2

    coord.send(0, m.SetGlobalStep(global_step=1))
    coord.broadcast(m.SetGlobalStep(global_step=2))
    beat(1, {0: 2, 1: 1})
    assert coord.overdue(30.0) == []  # everything sent was read
    coord.send(1, m.SyncNow())
    coord.broadcast(m.EvalBroadcast(epoch=1, metric=0.5))
    clock[0] += 10.0
    beat(2, {})  # alive 10 s later, nothing read: within the budget
    assert coord.overdue(30.0) == []
    clock[0] += 21.0
    assert coord.overdue(30.0) == []  # no heartbeat since: left to the heartbeat timeout
    beat(3, {})  # alive 31 s after, still nothing read
    late = coord.overdue(30.0)
    # each rank's oldest unread entry: rank 0 the broadcast, rank 1 its SyncNow
    assert [(r, what) for r, what, _ in late] == [(0, "EvalBroadcast"), (1, "SyncNow")]
    assert all(age == 31.0 for _, _, age in late)
    beat(4, {0: 1, 1: 2})  # reading and saying so clears it
    assert coord.overdue(30.0) == []
    for bus in (*ranks, coord):
        bus.close()
