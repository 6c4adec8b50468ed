"""What a writer without the run's keys can do to the streams, tried on purpose: entries at
future and maximum ids, entries copied under new ids, streams deleted and refilled with
old entries, forged broadcasts and another rank's entries. None of it stops a process or
a stream, none of it is dispatched, and all of it reaches the dlq with its reason."""

from __future__ import annotations

import time

import pytest
import redis

from flodl_bus.bus import entries
from flodl_bus.bus.join import JoinStream
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.streams import RedisCoordinatorBus, RedisRankBus
from flodl_bus.protocol import messages as m
from flodl_bus.protocol.messages import Assign, Hello
from flodl_bus.protocol.signing import CoordinatorIdentity, new_secret
from tests.bus.conftest import CK, FAST, RK, Backend
from tests.bus.test_streams import _batch, _steps, collect, collect_up

MAX_ID = "18446744073709551615-18446744073709551615"


def _reasons(admin: redis.Redis, keys: RunKeys) -> list[str]:
    return [f[b"reason"].decode() for _, f in admin.xrange(keys.dlq)]


def _now_ms() -> int:
    return int(time.time() * 1000)


@pytest.fixture
def real_backend(backend: Backend) -> Backend:
    if not backend.real:
        # fakeredis has no XSETID: the repair of a wedged stream needs the real server
        pytest.skip("needs redis-server (XSETID)")
    return backend


def test_a_future_id_on_every_stream_neither_stops_a_writer_nor_hides_what_follows(
    backend: Backend,
) -> None:
    keys = RunKeys("future")
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=[0], config=FAST)
    rank = RedisRankBus(backend.make(), keys, 0, RK(0), config=FAST)
    ahead = f"{_now_ms() + 5000}-0"
    for stream in (keys.ctl(0), keys.ctl_all, keys.up(0)):
        backend.admin.xadd(stream, {"junk": "x"}, id=ahead)
    for i in range(3):
        coord.send(0, m.SetGlobalStep(global_step=i))
        coord.broadcast(m.SetGlobalStep(global_step=10 + i))
        rank.publish(_batch(0, i))
    assert rank.flush(10)
    assert _steps(collect(rank, 6)) == [0, 10, 1, 11, 2, 12]
    assert [d.msg.step_count for d in collect_up(coord, 3)] == [0, 1, 2]  # type: ignore[attr-defined]
    reasons = _reasons(backend.admin, keys)
    assert len(reasons) == 3 and all(r.startswith("bad fields") for r in reasons)
    rank.close()
    coord.close()


def test_an_entry_at_the_largest_id_is_removed_and_both_directions_go_on(
    real_backend: Backend,
) -> None:
    """At the largest id Redis refuses every later XADD: the stream would be wedged for
    good. The coordinator removes the entry (dlq first) and sets the stream and its
    groups back; a rank's publisher waits for that instead of dying."""
    backend = real_backend
    keys = RunKeys("maxid")
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=[0, 1], config=FAST)
    ranks = [RedisRankBus(backend.make(), keys, r, RK(r), config=FAST) for r in (0, 1)]
    coord.broadcast(m.SetGlobalStep(global_step=1))
    assert _steps(collect(ranks[0], 1)) == [1]  # rank 0's group is past it; rank 1's not
    for stream in (keys.ctl_all, keys.ctl(0), keys.up(1)):
        backend.admin.xadd(stream, {"junk": "x"}, id=MAX_ID)
    # rank 0 reads the foreign entry: its group's last-delivered id becomes the largest
    assert collect(ranks[0], 1, timeout=0.5) == []
    coord.broadcast(m.SetGlobalStep(global_step=2))
    coord.send(0, m.SetGlobalStep(global_step=3))
    ranks[1].publish(_batch(1, 7))
    assert _steps(collect(ranks[0], 2)) == [2, 3]
    assert _steps(collect(ranks[1], 2)) == [1, 2]
    assert [d.msg.step_count for d in collect_up(coord, 1)] == [7]  # type: ignore[attr-defined]
    assert ranks[1].flush(10)
    reasons = _reasons(backend.admin, keys)
    assert sum(r.startswith("foreign: entry id beyond the horizon") for r in reasons) == 3
    for stream in (keys.ctl_all, keys.ctl(0), keys.up(1)):
        assert backend.admin.xinfo_stream(stream)["last-generated-id"] != MAX_ID.encode()
    for bus in (*ranks, coord):
        bus.close()


def test_a_valid_entry_copied_under_a_new_id_is_refused_as_replayed(backend: Backend) -> None:
    keys = RunKeys("copied")
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=[0], config=FAST)
    rank = RedisRankBus(backend.make(), keys, 0, RK(0), config=FAST)
    coord.send(0, m.StartEpoch(plan=m.EpochPlan(epoch=0, partition_offset=0, partition_size=8)))
    rank.publish(_batch(0, 1))
    assert rank.flush(10)
    got = collect(rank, 1)
    assert [type(d.msg) for d in got] == [m.StartEpoch]
    assert len(collect_up(coord, 1)) == 1
    admin = backend.admin
    for stream in (keys.ctl(0), keys.up(0)):
        ((_, fields),) = admin.xrange(stream)[-1:]
        admin.xadd(stream, fields)  # the same fields, a new id
    coord.send(0, m.SetGlobalStep(global_step=5))
    rank.publish(_batch(0, 2))
    assert rank.flush(10)
    assert _steps(collect(rank, 1)) == [5]
    assert [d.msg.step_count for d in collect_up(coord, 1)] == [2]  # type: ignore[attr-defined]
    reasons = _reasons(admin, keys)
    assert len(reasons) == 2 and all(r.startswith("replayed") for r in reasons), reasons
    rank.close()
    coord.close()


def test_a_stream_deleted_and_refilled_with_its_old_entries_dispatches_none_twice(
    backend: Backend,
) -> None:
    keys = RunKeys("refilled")
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=[0], config=FAST)
    rank = RedisRankBus(backend.make(), keys, 0, RK(0), config=FAST)
    for i in range(3):
        coord.send(0, m.SetGlobalStep(global_step=i))
    assert _steps(collect(rank, 3)) == [0, 1, 2]
    rank.flush_acks()
    admin = backend.admin
    old = admin.xrange(keys.ctl(0))
    admin.delete(keys.ctl(0))
    for eid, fields in old:
        admin.xadd(keys.ctl(0), fields, id=eid)
    coord.send(0, m.SetGlobalStep(global_step=3))
    # the reader reads on from its own cursor: the old entries lie below it
    assert _steps(collect(rank, 1)) == [3]
    assert collect(rank, 1, timeout=0.3) == []
    # a consumer group wound back to the start hands nothing to this reader: it has
    # none (a rank reads with XREAD, issue 28), so no one can rewind or drain it
    admin.xgroup_create(keys.ctl(0), "rank0", id="0")
    admin.xreadgroup("rank0", "thief", {keys.ctl(0): ">"})
    coord.send(0, m.SetGlobalStep(global_step=4))
    assert _steps(collect(rank, 1)) == [4]
    assert collect(rank, 1, timeout=0.3) == []
    assert _reasons(admin, keys) == []
    rank.close()
    coord.close()


def test_what_a_rank_holds_forges_neither_broadcasts_nor_another_ranks_entries(
    backend: Backend,
) -> None:
    keys = RunKeys("roles")
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=[0, 1], config=FAST)
    rank0 = RedisRankBus(backend.make(), keys, 0, RK(0), config=FAST)
    rank1 = RedisRankBus(backend.make(), keys, 1, RK(1), config=FAST)
    mine = RK(1).rank_key  # all that rank 1 holds
    admin = backend.admin
    now = _now_ms()
    # each signed for the id it is added at, so only the key can refuse it
    forged = [
        (keys.ctl_all, f"{now}-7", m.Shutdown(), "all"),
        (keys.ctl(0), f"{now}-8", m.Shutdown(), "0"),
        (keys.up(0), f"{now}-9", _batch(0, 9), "0"),
    ]
    for stream, eid, msg, owner in forged:
        fields = entries.build(mine, stream, eid, msg, owner, 99)
        admin.xadd(stream, fields, id=eid)  # type: ignore[arg-type]
    coord.broadcast(m.SetGlobalStep(global_step=1))
    rank1.publish(_batch(1, 1))
    assert rank1.flush(10)
    assert _steps(collect(rank0, 1)) == [1]
    assert [d.msg.rank for d in collect_up(coord, 1)] == [1]  # type: ignore[attr-defined]
    assert collect(rank0, 1, timeout=0.3) == []
    reasons = _reasons(admin, keys)
    assert len(reasons) == 3 and all(r.startswith("authentication failed") for r in reasons)
    for bus in (rank0, rank1, coord):
        bus.close()


def test_the_join_stream_wedged_at_the_largest_id_is_repaired_by_the_coordinator(
    real_backend: Backend,
) -> None:
    backend = real_backend
    keys = RunKeys("joinmax")
    secret = new_secret()
    coordinator = CoordinatorIdentity.generate()
    coord = JoinStream(backend.make(), keys, secret, signer=coordinator.signing)
    worker = JoinStream(backend.make(), keys, secret, answers=coordinator.signing.public)
    worker.post(Hello("w0", "h", "sig"))
    backend.admin.xadd(keys.join, {"junk": "x"}, id=MAX_ID)
    got, cursor = coord.read("0", None)
    assert [m.worker_id for _, m in got] == ["w0"]  # type: ignore[union-attr]
    # the coordinator removed it: both sides can write again, and read what follows
    coord.post(Assign("w0", 0, 2))
    worker.post(Hello("w1", "h", "sig"))
    more, _ = coord.read(cursor, None)
    assert [type(m).__name__ for _, m in more] == ["Assign", "Hello"]
    reasons = _reasons(backend.admin, keys)
    assert reasons and all(r.startswith("foreign") for r in reasons)
