"""StreamWatcher on a real redis-server: an observer that sees everything, takes nothing."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis

from flodl_bus.bus import entries
from flodl_bus.bus.api import Delivery
from flodl_bus.bus.connection import connect
from flodl_bus.bus.join import JoinStream
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.streams import RedisCoordinatorBus, RedisRankBus
from flodl_bus.launch.watch import Seen, StreamWatcher
from flodl_bus.protocol.messages import (
    Assign,
    Batch,
    EvalBroadcast,
    Heartbeat,
    Hello,
    SyncNow,
    WireUpdate,
)
from flodl_bus.protocol.signing import (
    CoordinatorIdentity,
    CoordinatorKeys,
    RankKeys,
    RankKx,
    fixed_keys,
    new_secret,
)

pytestmark = pytest.mark.redis


def _batch(rank: int, step: int) -> Batch:
    return Batch(rank=rank, batch_ms=1.0, data_ms=0.0, step_count=step, batch_loss=0.1)


def _world(
    client: redis.Redis, keys: RunKeys, n: int
) -> tuple[CoordinatorIdentity, CoordinatorKeys, list[RankKeys]]:
    """A joined world of ``n`` ranks on the join stream, keys made as the coordinator
    and each rank make them (each side derives the rank key on its own)."""
    ident = CoordinatorIdentity.generate()
    join = JoinStream(client, keys, new_secret(), signer=ident.signing)
    coord = CoordinatorKeys(ident.signing)
    ranks = []
    for r in range(n):
        kx = RankKx.generate()
        join.post(Hello(f"w{r}", "h", "sig", kx_pub=kx.pub))
        join.post(Assign(f"w{r}", r, n))
        coord.ranks[r] = ident.rank_key(keys.run, r, kx.pub)
        ranks.append(RankKeys(kx.rank_key(ident.public, keys.run, r), ident.signing.public))
    return ident, coord, ranks


def _collect(watcher: StreamWatcher, want: int, timeout: float = 5.0) -> list[Seen]:
    got: list[Seen] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got += watcher.poll(block_ms=100)
    return got


def _read(read: Callable[[], list[Delivery]], want: int) -> list[Delivery]:
    # A group reader's first call drains its own pending entries (none): read until
    # the entries arrive or the deadline passes.
    got: list[Delivery] = []
    deadline = time.monotonic() + 5.0
    while len(got) < want and time.monotonic() < deadline:
        got += read()
    return got


def test_the_watcher_sees_a_burst_of_upstream_entries_in_order(
    real_redis: redis.Redis, redis_url: str
) -> None:
    client = connect(redis_url)
    ident, _, rks = _world(client, RunKeys("w1"), 1)
    rank_bus = RedisRankBus(client, "w1", 0, rks[0])
    try:
        watcher = StreamWatcher(connect(redis_url), RunKeys("w1"), 1, ident)
        for step in range(1, 2501):  # more than one XREAD COUNT
            rank_bus.publish(_batch(0, step))
        assert rank_bus.flush(5.0)
        seen = _collect(watcher, 2500)
        steps = [s.msg.step_count for s in seen if isinstance(s.msg, Batch)]  # type: ignore[attr-defined]
        assert steps == list(range(1, 2501))
        assert all(s.upstream and s.rank == 0 for s in seen)
    finally:
        rank_bus.close()
        client.close()


def test_watching_takes_no_entry_from_the_consumer_groups(
    real_redis: redis.Redis, redis_url: str
) -> None:
    client = connect(redis_url)
    ident, ck, rks = _world(client, RunKeys("w2"), 2)
    coord = RedisCoordinatorBus(client, "w2", ck, ranks=[0, 1])
    ranks = [RedisRankBus(connect(redis_url), "w2", r, rks[r]) for r in (0, 1)]
    try:
        watcher = StreamWatcher(connect(redis_url), RunKeys("w2"), 2, ident)
        coord.send(0, SyncNow())
        coord.send(1, WireUpdate(version=3))
        coord.broadcast(EvalBroadcast(epoch=1, metric=0.5))
        ranks[1].publish(Heartbeat(rank=1, step_count=4))
        assert ranks[1].flush(5.0)
        seen = _collect(watcher, 4)
        kinds = {(s.upstream, s.rank, type(s.msg).__name__) for s in seen}
        assert len(seen) == 4
        assert kinds == {
            (False, 0, "SyncNow"),
            (False, 1, "WireUpdate"),
            (False, None, "EvalBroadcast"),
            (True, 1, "Heartbeat"),
        }
        # The runtimes still get every entry through their groups.
        got_0 = _read(lambda: ranks[0].read_control(200), 2)
        got_1 = _read(lambda: ranks[1].read_control(200), 2)
        up = _read(lambda: coord.read_upstream(200), 1)
        assert [type(d.msg).__name__ for d in got_0] == ["SyncNow", "EvalBroadcast"]
        assert [type(d.msg).__name__ for d in got_1] == ["WireUpdate", "EvalBroadcast"]
        assert [type(d.msg).__name__ for d in up] == ["Heartbeat"]
    finally:
        for rb in ranks:
            rb.close()
        coord.close()
        client.close()


def test_entries_that_fail_authentication_are_counted_not_shown(
    real_redis: redis.Redis, redis_url: str
) -> None:
    keys = RunKeys("w3")
    ident, ck, _ = _world(real_redis, keys, 1)
    watcher = StreamWatcher(connect(redis_url), keys, 1, ident)
    stream = keys.up(0)
    other = fixed_keys(b"another run").rank(0)
    real_redis.xadd(stream, entries.build(other, stream, "5-1", _batch(0, 1), "0", 1), id="5-1")  # type: ignore[arg-type]
    real_redis.xadd(
        stream, entries.build(ck.rank(0), stream, "5-2", _batch(0, 2), "0", 2), id="5-2"
    )  # type: ignore[arg-type]
    real_redis.xadd(stream, {b"type": b"Batch", b"junk": b"1"})
    seen = _collect(watcher, 1)
    time.sleep(0.1)
    seen += watcher.poll(block_ms=None)
    assert [s.msg.step_count for s in seen] == [2]  # type: ignore[attr-defined]
    assert watcher.rejected == 2


def test_drain_reads_what_is_left_without_blocking(real_redis: redis.Redis, redis_url: str) -> None:
    keys = RunKeys("w4")
    ident, ck, _ = _world(real_redis, keys, 2)
    watcher = StreamWatcher(connect(redis_url), keys, 2, ident)
    for step in range(1, 4):
        stream = keys.up(1)
        eid = f"7-{step}"
        fields = entries.build(ck.rank(1), stream, eid, _batch(1, step), "1", step)
        real_redis.xadd(stream, fields, id=eid)  # type: ignore[arg-type]
    got: list[Seen] = []
    t0 = time.monotonic()
    watcher.drain(got.append)
    watcher.drain(got.append)  # nothing left: returns at once
    assert time.monotonic() - t0 < 0.5
    assert len(got) == 3


def test_a_foreign_largest_id_never_moves_the_cursor_past_what_the_run_writes_later(
    real_redis: redis.Redis, redis_url: str
) -> None:
    from flodl_bus.bus.foreign import repair_stream
    from flodl_bus.bus.ids import parse_id

    keys = RunKeys("w5")
    ident, ck, _ = _world(real_redis, keys, 1)
    watcher = StreamWatcher(connect(redis_url), keys, 1, ident)
    stream = keys.up(0)

    def genuine(eid: str, step: int) -> None:
        fields = entries.build(ck.rank(0), stream, eid, _batch(0, step), "0", step)
        real_redis.xadd(stream, fields, id=eid)  # type: ignore[arg-type]

    genuine("5-1", 1)
    top = "18446744073709551615-18446744073709551615"
    real_redis.xadd(stream, {b"type": b"Batch", b"rank": b"0"}, id=top)
    assert [s.msg.step_count for s in _collect(watcher, 1)] == [1]  # type: ignore[attr-defined]
    for _ in range(3):  # read again and again while it sits there: counted once
        assert watcher.poll(block_ms=50) == []
    assert watcher.rejected == 1
    # The coordinator removes it (what it does for a foreign id beyond the run's) and
    # the rank writes on: the watcher shows it.
    now_ms = int(time.time() * 1000)
    assert repair_stream(real_redis, stream, keys.dlq, floor=parse_id("5-1"), now_ms=now_ms, by="t")
    genuine(f"{now_ms}-0", 2)
    assert [s.msg.step_count for s in _collect(watcher, 1)] == [2]  # type: ignore[attr-defined]


def test_an_entry_written_before_its_ranks_assign_is_shown_once_the_key_is_known(
    real_redis: redis.Redis, redis_url: str
) -> None:
    # A rank given its --rank heartbeats while it sets up, before the world forms and
    # the coordinator's Assign names its key: not a forgery, and not to be skipped.
    keys = RunKeys("w6")
    ident = CoordinatorIdentity.generate()
    join = JoinStream(real_redis, keys, new_secret(), signer=ident.signing)
    kx = RankKx.generate()
    join.post(Hello("w0", "h", "sig", kx_pub=kx.pub))
    key = ident.rank_key(keys.run, 0, kx.pub)
    watcher = StreamWatcher(connect(redis_url), keys, 1, ident)
    stream = keys.up(0)
    beat = Heartbeat(rank=0, step_count=1)
    real_redis.xadd(stream, entries.build(key, stream, "5-1", beat, "0", 1), id="5-1")  # type: ignore[arg-type]
    for _ in range(2):
        assert watcher.poll(block_ms=50) == []  # not judged without its key
    join.post(Assign("w0", 0, 1))
    seen = _collect(watcher, 1)
    assert [type(s.msg).__name__ for s in seen] == ["Heartbeat"]
    assert watcher.rejected == 0
