"""The rank's publisher lets a step's reports linger, so one transaction carries a run of
steps, and never lets that change what the coordinator sees or when it must see it."""

from __future__ import annotations

import dataclasses
import time

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


def _pair(backend: Backend, run: str) -> tuple[RedisRankBus, RedisCoordinatorBus]:
    rank = RedisRankBus(backend.make(), run, 0, RK(0), config=LONG)
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
