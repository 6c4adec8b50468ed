"""The rank's publisher lets a step's reports linger, so one transaction carries a run of
steps, and never lets that change what the coordinator sees or when it must see it."""

from __future__ import annotations

import dataclasses
import time

from flodl_bus.bus.api import Delivery
from flodl_bus.bus.ids import parse_id
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.stream_ops import SOLO_PUBLISH_LINGER_S, StreamsConfig, rank_streams_config
from flodl_bus.bus.streams import RedisCoordinatorBus, RedisRankBus
from flodl_bus.protocol import messages as m
from tests.bus.conftest import CK, FAST, RK, Backend
from tests.bus.test_streams import collect_up

#: long enough that only an urgent message, a flush or close can end it in a test
LONG = dataclasses.replace(FAST, publish_linger_s=60.0)


def _batch(i: int) -> m.Batch:
    return m.Batch(rank=0, batch_ms=1.0, data_ms=0.1, step_count=i, batch_loss=0.5)


def _metrics() -> m.MetricsMsg:
    return m.MetricsMsg(0, 0, 0.5, 3, 10.0, 96, 8.0, 6.0, 2.0)


def _pair(
    backend: Backend, run: str, config: StreamsConfig = LONG
) -> tuple[RedisRankBus, RedisCoordinatorBus]:
    rank = RedisRankBus(backend.make(), run, 0, RK(0), config=config)
    coord = RedisCoordinatorBus(backend.make(), run, CK, ranks=[0], config=FAST)
    return rank, coord


def test_an_urgent_message_goes_at_once_with_every_lingering_one_before_it_in_order(
    backend: Backend,
) -> None:
    rank, coord = _pair(backend, "linger-urgent")
    try:
        for i in range(1, 4):
            rank.publish(_batch(i))
        rank.publish(m.LrUpdate(rank=0, lr=0.1))
        rank.publish(_metrics())  # a plan's end: the coordinator acts on it
        started = time.monotonic()
        got = collect_up(coord, 5, timeout=20.0)
        # far inside the linger: the MetricsMsg ended it
        assert time.monotonic() - started < LONG.publish_linger_s / 4
        assert [type(d.msg).__name__ for d in got] == [
            "Batch",
            "Batch",
            "Batch",
            "LrUpdate",
            "MetricsMsg",
        ]
        assert [d.msg.step_count for d in got if isinstance(d.msg, m.Batch)] == [1, 2, 3]
    finally:
        rank.close()
        coord.close()


def test_a_lone_step_report_waits_for_company_until_flush_or_close_writes_it(
    backend: Backend,
) -> None:
    rank, coord = _pair(backend, "linger-lone")
    try:
        rank.publish(_metrics())
        assert [type(d.msg).__name__ for d in collect_up(coord, 1, timeout=20.0)] == ["MetricsMsg"]
        # the first step after it too: without publish_first_step it is no news
        rank.publish(_batch(1))
        rank.publish(m.Heartbeat(rank=0, step_count=1))
        # lingering: nothing on the stream yet (a short look; the linger is a minute)
        assert coord.read_upstream(300) == []
        assert rank.flush(10.0)  # a flush is urgent
        got = collect_up(coord, 2, timeout=20.0)
        assert [type(d.msg).__name__ for d in got] == ["Batch", "Heartbeat"]
        rank.publish(_batch(2))
    finally:
        rank.close()  # writes what still lingers
    try:
        got = collect_up(coord, 1, timeout=20.0)
        assert [d.msg.step_count for d in got if isinstance(d.msg, m.Batch)] == [2]
    finally:
        coord.close()


def test_with_first_step_on_the_first_report_after_news_goes_at_once_and_the_rest_linger(
    backend: Backend,
) -> None:
    """A plan's first step (after the run's start or the last plan's end) is what the
    coordinator sends a world of one its next plan on: it must not wait out a linger."""
    rank = RedisRankBus(
        backend.make(),
        "linger-first",
        0,
        RK(0),
        config=dataclasses.replace(LONG, publish_first_step=True),
    )
    coord = RedisCoordinatorBus(backend.make(), "linger-first", CK, ranks=[0], config=FAST)
    started = time.monotonic()
    try:
        rank.publish(_batch(1))
        assert _steps(collect_up(coord, 1, timeout=20.0)) == [1]
        rank.publish(_batch(2))
        assert coord.read_upstream(300) == []  # the second step lingers
        rank.publish(_metrics())  # the plan's end: news, and the step before it goes too
        assert [type(d.msg).__name__ for d in collect_up(coord, 2, timeout=20.0)] == [
            "Batch",
            "MetricsMsg",
        ]
        rank.publish(_batch(3))  # the next plan's first step
        assert _steps(collect_up(coord, 1, timeout=20.0)) == [3]
        rank.publish(_batch(4))
        rank.publish(m.Heartbeat(rank=0, step_count=4))  # lazy, not news: 4 still lingers
        assert coord.read_upstream(300) == []
        # every write above came far inside the minute's linger
        assert time.monotonic() - started < LONG.publish_linger_s / 4
    finally:
        rank.close()
        coord.close()


def _eval_result() -> m.EvalResult:
    return m.EvalResult(rank=0, schedule_id=1, epoch=1, metric=0.9, elapsed_ms=1.0)


def _solo_pair(backend: Backend, run: str) -> tuple[RedisRankBus, RedisCoordinatorBus]:
    solo = dataclasses.replace(LONG, publish_first_step=True, publish_epoch_end_lazy=True)
    return _pair(backend, run, solo)


def test_with_epoch_end_lazy_a_plans_metrics_and_eval_go_with_the_next_plans_first_step(
    backend: Backend,
) -> None:
    """A world of one holds its next plan: its epoch's end (the MetricsMsg, the eval's
    result) goes in one write with the next plan's first step, in order."""
    rank, coord = _solo_pair(backend, "linger-epoch-end")
    started = time.monotonic()
    try:
        rank.publish(_batch(1))  # the run's first step goes at once
        assert _steps(collect_up(coord, 1, timeout=20.0)) == [1]
        rank.publish(_batch(2))
        rank.publish(_metrics())
        rank.publish(_eval_result())
        assert coord.read_upstream(300) == []  # the epoch's end lingers
        rank.publish(_batch(3))  # the next plan's first step: news after the end
        got = collect_up(coord, 4, timeout=20.0)
        assert [type(d.msg).__name__ for d in got] == [
            "Batch",
            "MetricsMsg",
            "EvalResult",
            "Batch",
        ]
        rank.publish(_batch(4))  # not news: it lingers again
        assert coord.read_upstream(300) == []
        assert time.monotonic() - started < LONG.publish_linger_s / 4
    finally:
        rank.close()
        coord.close()


def test_hurry_writes_a_lingering_epoch_end_at_once_even_one_the_thread_holds(
    backend: Backend,
) -> None:
    """The rank hurries its publisher before it blocks on its control: a MetricsMsg the
    coordinator must answer never waits out the linger, taken off the queue or not."""
    rank, coord = _solo_pair(backend, "linger-hurry")
    started = time.monotonic()
    try:
        rank.publish(_metrics())
        # the thread took it and lingers with it in hand: the queue is empty now
        assert coord.read_upstream(300) == []
        rank.hurry()
        assert [type(d.msg).__name__ for d in collect_up(coord, 1, timeout=20.0)] == ["MetricsMsg"]
        rank.publish(_batch(1))  # news after the end: at once
        rank.publish(_batch(2))
        rank.publish(_eval_result())
        rank.hurry()
        got = collect_up(coord, 3, timeout=20.0)
        assert [type(d.msg).__name__ for d in got] == ["Batch", "Batch", "EvalResult"]
        assert time.monotonic() - started < LONG.publish_linger_s / 4
    finally:
        rank.close()
        coord.close()


def test_without_epoch_end_lazy_hurry_ends_no_linger(backend: Backend) -> None:
    """Several ranks' publishers hold nothing their coordinator must answer: a rank
    that blocks on its control must not send its next step report early (a sync
    round would fire sooner, and a run make more of them)."""
    rank, coord = _pair(backend, "linger-no-hurry")
    try:
        rank.publish(_batch(1))
        rank.hurry()
        assert coord.read_upstream(300) == []  # still lingering
        rank.publish(_batch(2))  # a stale hurry would have sent this at once
        assert coord.read_upstream(300) == []
        assert rank.flush(10.0)
        assert _steps(collect_up(coord, 2, timeout=20.0)) == [1, 2]
    finally:
        rank.close()
        coord.close()


def test_with_no_linger_every_report_is_written_as_it_comes(backend: Backend) -> None:
    rank = RedisRankBus(
        backend.make(),
        "linger-none",
        0,
        RK(0),
        config=dataclasses.replace(FAST, publish_linger_s=0),
    )
    coord = RedisCoordinatorBus(backend.make(), "linger-none", CK, ranks=[0], config=FAST)
    try:
        rank.publish(_batch(1))
        got = collect_up(coord, 1, timeout=20.0)
        assert [d.msg.step_count for d in got if isinstance(d.msg, m.Batch)] == [1]
    finally:
        rank.close()
        coord.close()


def _urgent_batch(rank: RedisRankBus, first: int, n: int) -> None:
    """``n`` step reports and a plan's end: one transaction, written at once."""
    for i in range(first, first + n):
        rank.publish(_batch(i))
    rank.publish(_metrics())
    assert rank.flush(10.0)


def _steps(got: list[Delivery]) -> list[int]:
    return [d.msg.step_count for d in got if isinstance(d.msg, m.Batch)]


def test_a_foreign_entry_between_two_batches_lifts_the_next_one_whole_above_it(
    backend: Backend,
) -> None:
    """Between batches the publisher's connection holds the next batch's WATCH and the
    top it read: an entry written meanwhile must abort that EXEC, and the batch goes
    whole, in order, above the foreign top. The reader's ``Link`` disconnecting the
    client's pool (after a MOVED) in between must not drop that watch: redis-py would
    reconnect without it, and the XADDs under the foreign top would be refused one by
    one inside an EXEC that still answers."""
    client = backend.make()
    rank = RedisRankBus(client, "armed-foreign", 0, RK(0), config=LONG)
    coord = RedisCoordinatorBus(backend.make(), "armed-foreign", CK, ranks=[0], config=FAST)
    up = RunKeys("armed-foreign").up(0)
    try:
        _urgent_batch(rank, 1, 3)
        assert _steps(collect_up(coord, 4)) == [1, 2, 3]
        client.connection_pool.disconnect()
        ahead = f"{int(time.time() * 1000) + 60_000}-0"  # ahead of any id of ours in the test
        backend.admin.xadd(up, {"junk": "x"}, id=ahead)
        _urgent_batch(rank, 4, 3)
        assert _steps(collect_up(coord, 4)) == [4, 5, 6]
        ids = [parse_id(raw) for raw, _ in backend.admin.xrange(up)]
        foreign = ids.index(parse_id(ahead))
        assert len(ids) == 9 and foreign == 4, ids  # 4 entries of ours below, 4 above
        assert ids == sorted(ids)
    finally:
        rank.close()
        coord.close()


def test_a_trim_between_two_batches_costs_a_renumbering_not_an_entry(backend: Backend) -> None:
    """The coordinator's trim pass changes the stream under the armed watch: the next
    EXEC answers nil and the batch is written again above the top read after it."""
    rank, coord = _pair(backend, "armed-trim")
    up = RunKeys("armed-trim").up(0)
    try:
        _urgent_batch(rank, 1, 2)
        got = collect_up(coord, 3)
        assert _steps(got) == [1, 2]
        last = backend.admin.xrevrange(up, count=1)[0][0]
        assert backend.admin.xtrim(up, minid=last, approximate=False) == 2
        _urgent_batch(rank, 3, 2)
        assert _steps(collect_up(coord, 3)) == [3, 4]
        assert len(backend.admin.xrange(up)) == 4
    finally:
        rank.close()
        coord.close()


def test_once_armed_a_batch_costs_the_publisher_one_write_to_redis(backend: Backend) -> None:
    """Every round trip wakes the publisher and hands it the GIL, which the training
    thread pays for (issue 27): after the first batch, which arms the connection, a
    batch is one packed write (its MULTI, XADDs and EXEC, and the next batch's WATCH and
    top)."""
    rank, coord = _pair(backend, "armed-writes")
    try:
        _urgent_batch(rank, 1, 2)
        publisher = rank._publisher
        conn = publisher._conn
        sends: list[int] = []
        original = conn.send_packed_command

        def counted(command: object, check_health: bool = True) -> None:
            sends.append(1)
            original(command, check_health)

        conn.send_packed_command = counted
        for first in range(3, 3 + 5 * 2, 2):
            _urgent_batch(rank, first, 2)
        assert len(sends) == 5
        assert _steps(collect_up(coord, 18)) == list(range(1, 13))
    finally:
        rank.close()
        coord.close()


def test_only_a_world_of_one_lingers_longer_and_sends_its_plans_first_step_at_once() -> None:
    solo = rank_streams_config(1)
    assert solo is not None
    assert (solo.publish_linger_s, solo.publish_first_step) == (SOLO_PUBLISH_LINGER_S, True)
    assert solo.publish_epoch_end_lazy
    assert StreamsConfig().publish_linger_s < SOLO_PUBLISH_LINGER_S
    assert rank_streams_config(2) is None
    assert not StreamsConfig().publish_first_step
    assert not StreamsConfig().publish_epoch_end_lazy
