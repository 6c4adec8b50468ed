"""The coordinator's sender thread (``coordinator.sender``): order, batching, refusals,
backpressure and its end; and that the bus it writes on lets the loop read meanwhile."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
import redis

from flodl_bus.bus.api import Delivery
from flodl_bus.bus.connection import connect
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.streams import RedisCoordinatorBus, RedisRankBus
from flodl_bus.coordinator.effects import Broadcast, Send
from flodl_bus.coordinator.sender import SendLane
from flodl_bus.protocol import messages as m
from tests.bus.conftest import CK, FAST, RK

Item = Send | Broadcast


def step(i: int) -> m.SetGlobalStep:
    return m.SetGlobalStep(global_step=i)


class GatedBus:
    """Records each ``send_batch`` and holds the first one until ``gate`` opens (a round
    trip in flight), refusing any batch holding a step in ``refuse``."""

    def __init__(self, refuse: frozenset[int] = frozenset()) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls: list[list[tuple[int | None, int]]] = []
        self.refuse = refuse

    def send_batch(self, items: Sequence[tuple[int | None, m.SetGlobalStep]]) -> list[str]:
        self.entered.set()
        self.gate.wait(30)
        got = [(rank, msg.global_step) for rank, msg in items]
        if any(s in self.refuse for _, s in got):
            raise ConnectionError("refused")
        self.calls.append(got)
        return [str(i) for i in range(len(items))]

    def send(self, rank: int, msg: object) -> None:
        raise AssertionError("a bus with send_batch is written through it")

    def broadcast(self, msg: object) -> None:
        raise AssertionError("a bus with send_batch is written through it")

    def read_upstream(self, block_ms: int) -> Sequence[Delivery]:
        return []

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        pass

    behind = False

    def close(self) -> None:
        pass


def wait_for(cond: threading.Event, what: str) -> None:
    assert cond.wait(30), f"timed out waiting for {what}"


def test_writes_keep_the_put_order_and_what_waited_together_goes_in_one_call() -> None:
    bus = GatedBus()
    lane = SendLane(bus, max_batch=3)  # type: ignore[arg-type]
    lane.put([Send(0, step(0))])
    wait_for(bus.entered, "the first write")  # held in flight: the rest queue behind it
    lane.put([Send(1, step(1)), Send(2, step(2))])
    lane.put([Send(3, step(3)), Broadcast(step(4)), Broadcast(step(5))])
    lane.put([Send(0, step(6)), Send(1, step(7)), Send(2, step(8)), Send(3, step(9))])
    bus.gate.set()
    assert lane.drain(30)
    # Consecutive unicasts of three puts go in one call, up to max_batch; a broadcast
    # never shares one with a unicast; nothing is reordered.
    assert bus.calls == [
        [(0, 0)],
        [(1, 1), (2, 2), (3, 3)],
        [(None, 4), (None, 5)],
        [(0, 6), (1, 7), (2, 8)],
        [(3, 9)],
    ]
    assert (lane.sent, lane.broadcasts, lane.calls) == (8, 2, 5)
    assert lane.take() == []
    assert lane.close()


def test_a_refused_write_hands_back_each_of_its_items_in_order_and_later_ones_still_go() -> None:
    bus = GatedBus(refuse=frozenset({2}))
    lane = SendLane(bus)  # type: ignore[arg-type]
    lane.put([Send(0, step(0))])
    wait_for(bus.entered, "the first write")
    lane.put([Send(1, step(1)), Send(0, step(2)), Send(1, step(3))])
    lane.put([Broadcast(step(4))])
    bus.gate.set()
    assert lane.drain(30)
    assert lane.refused_waiting
    refused = lane.take()
    # the batch is one transaction: every item of it comes back, in order
    assert [(r.item.msg.global_step, type(r.error)) for r in refused] == [  # type: ignore[union-attr]
        (1, ConnectionError),
        (2, ConnectionError),
        (3, ConnectionError),
    ]
    assert [call for call in bus.calls] == [[(0, 0)], [(None, 4)]]
    assert lane.take() == [] and not lane.refused_waiting
    lane.close()


def test_a_full_lane_blocks_the_put_until_the_thread_takes_room() -> None:
    bus = GatedBus()
    lane = SendLane(bus, max_queued=2)  # type: ignore[arg-type]
    lane.put([Send(0, step(0))])
    wait_for(bus.entered, "the first write")
    lane.put([Send(0, step(1)), Send(0, step(2))])  # the queue is now full
    done = threading.Event()

    def put_more() -> None:
        lane.put([Send(0, step(3))])
        done.set()

    t = threading.Thread(target=put_more, daemon=True)
    t.start()
    # Still blocked while the first write hangs: nothing was taken since.
    assert not done.wait(0.2)
    assert lane.pending == 3
    bus.gate.set()
    wait_for(done, "the blocked put")
    assert lane.drain(30)
    assert [s for call in bus.calls for _, s in call] == [0, 1, 2, 3]
    lane.close()


def test_close_writes_what_was_queued_before_the_thread_stops() -> None:
    bus = GatedBus()
    lane = SendLane(bus)  # type: ignore[arg-type]
    lane.put([Send(0, step(0))])
    wait_for(bus.entered, "the first write")
    lane.put([Broadcast(step(1))])
    closer = threading.Thread(target=lane.close, daemon=True)
    closer.start()
    bus.gate.set()
    closer.join(30)
    assert not closer.is_alive()
    assert bus.calls == [[(0, 0)], [(None, 1)]]


def test_a_send_in_flight_does_not_hold_up_the_reads_heartbeats_or_unread_checks(
    redis_url: str,
) -> None:
    # The sender thread's round trip holds the bus's send lock; what the loop does on
    # its own thread (a heartbeat's read positions, the unread check) must not wait
    # for it. Redis is told to hold writes (CLIENT PAUSE WRITE): the send hangs.
    keys = RunKeys("sender-lock")
    admin = redis.Redis.from_url(redis_url)
    coord = RedisCoordinatorBus(connect(redis_url), keys, CK, ranks=range(2), config=FAST)
    rank = RedisRankBus(connect(redis_url), keys, 0, RK(0), config=FAST)
    lane = SendLane(coord)
    try:
        admin.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
        try:
            lane.put([Send(0, step(0)), Send(1, step(1))])
            deadline = time.monotonic() + 30
            while coord._lock.acquire(blocking=False):  # not yet taken by the send
                coord._lock.release()
                assert time.monotonic() < deadline, "the send never started"
                time.sleep(0.001)
            done = threading.Event()

            def loop_side() -> None:
                coord._note_read(m.Heartbeat(rank=0, step_count=0, ctl_read="0-0", all_read="0-0"))
                coord.overdue(1.0)
                coord.read_holds()
                done.set()

            threading.Thread(target=loop_side, daemon=True).start()
            wait_for(done, "the loop's calls while a send is in flight")
            assert lane.pending == 1  # the send was still hanging meanwhile
        finally:
            admin.execute_command("CLIENT", "UNPAUSE")
        assert lane.drain(30) and lane.take() == []
        got = rank.read_control(5000)
        assert [d.msg for d in got] == [step(0)]
    finally:
        lane.close()
        rank.close()
        coord.close()
        admin.close()


class Crash(BaseException):
    """What no write's error handling takes: the sender thread dies of it."""


class CrashingBus(GatedBus):
    def send_batch(self, items: Sequence[tuple[int | None, m.SetGlobalStep]]) -> list[str]:
        super().send_batch(items)
        raise Crash()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_lane_whose_thread_died_hands_its_write_back_and_refuses_the_next_put() -> None:
    bus = CrashingBus()
    bus.gate.set()
    lane = SendLane(bus, max_queued=1)  # type: ignore[arg-type]
    lane.put([Send(0, step(0))])
    lane._thread.join(30)
    assert not lane._thread.is_alive()
    # the write it died on comes back to the loop as refused: not lost in silence
    assert lane.drain(1.0)
    (refused,) = lane.take()
    assert refused.item == Send(0, step(0)) and "died" in str(refused.error)
    # and a put says so at once instead of waiting for room that never comes
    with pytest.raises(RuntimeError, match="sender thread died"):
        lane.put([Send(0, step(1))])
