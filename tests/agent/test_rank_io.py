"""A rank's bus in a process of its own (``flodl_bus.agent.rank_io``), against a real
redis-server and a real child process: upstream in publish order and nothing lost at
close, control verified and in send order with a forged entry dead-lettered, the
heartbeats' read positions, and the child's death, signals and its rank's death."""

from __future__ import annotations

import dataclasses
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from flodl_bus.agent.rank_io import RankIoBus
from flodl_bus.bus import entries
from flodl_bus.bus.api import BusLost, Delivery
from flodl_bus.bus.connection import connect
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.stream_ops import BusError
from flodl_bus.bus.streams import RedisCoordinatorBus
from flodl_bus.examples import digits
from flodl_bus.protocol import messages as m
from flodl_bus.worker.inbox import Inbox
from flodl_bus.worker.runtime import RankRuntime, RuntimeConfig
from tests.bus.conftest import CK, FAST, RK
from tests.bus.test_streams import collect, collect_up
from tests.worker.rig import ObservedParams

pytestmark = [pytest.mark.redis]

KEYS = RunKeys("rankio")


@pytest.fixture
def coord(real_redis: redis.Redis, redis_url: str) -> Iterator[RedisCoordinatorBus]:
    bus = RedisCoordinatorBus(connect(redis_url), KEYS, CK, ranks=range(2), config=FAST)
    yield bus
    bus.close()


@pytest.fixture
def rank_bus(coord: RedisCoordinatorBus, redis_url: str) -> Iterator[RankIoBus]:
    bus = RankIoBus(redis_url, KEYS, 0, RK(0), config=FAST)
    yield bus
    bus.close()


def _upstream(coord: RedisCoordinatorBus, want: int, timeout: float = 60.0) -> list[Delivery]:
    return collect_up(coord, want, timeout)


def _control(bus: RankIoBus, want: int, timeout: float = 60.0) -> list[Delivery]:
    return collect(bus, want, timeout)  # type: ignore[arg-type]


def _batch(i: int) -> m.Batch:
    return m.Batch(rank=0, batch_ms=1.0, data_ms=0.1, step_count=i, batch_loss=0.5)


def test_upstream_goes_in_publish_order_and_nothing_queued_is_lost_at_close(
    coord: RedisCoordinatorBus, redis_url: str
) -> None:
    # a linger beyond the test: the last step reports are still held when it closes
    config = dataclasses.replace(FAST, publish_linger_s=3600.0)
    bus = RankIoBus(redis_url, KEYS, 0, RK(0), config=config)
    sent: list[object] = []
    for i in range(1, 401):
        # lingering step reports with reports the coordinator acts on between them
        msg: object = _batch(i) if i % 50 != 25 else m.SyncAck(rank=0, step_count=i)
        bus.publish(msg)  # type: ignore[arg-type]
        sent.append(msg)
    bus.close()  # no flush first: the close itself writes what is queued
    got = _upstream(coord, len(sent))
    # The coordinator's bus verified each entry's MAC (rank 0's key) and seq.
    assert [d.msg for d in got] == sent
    assert {d.stream for d in got} == {KEYS.up(0)}
    assert _upstream(coord, 1, timeout=0.5) == []


def test_a_report_the_coordinator_acts_on_goes_at_once_and_step_reports_wait_for_it(
    coord: RedisCoordinatorBus, redis_url: str
) -> None:
    """The publisher's rules, kept on the publishing thread: with a linger far beyond
    the test, step reports wait (for a report the coordinator acts on, the rank's wait
    on its control, or a heartbeat), and with ``publish_first_step`` the first step
    report after such a report goes at once."""
    config = dataclasses.replace(FAST, publish_linger_s=3600.0, publish_first_step=True)
    bus = RankIoBus(redis_url, KEYS, 0, RK(0), config=config)
    try:
        bus.publish(_batch(1))  # the first report: news for a world of one
        assert [d.msg for d in _upstream(coord, 1)] == [_batch(1)]
        bus.publish(_batch(2))
        bus.publish(_batch(3))
        assert _upstream(coord, 1, timeout=1.0) == []  # they wait for company
        bus.publish(m.SyncAck(rank=0, step_count=3))
        assert [d.msg for d in _upstream(coord, 3)] == [
            _batch(2),
            _batch(3),
            m.SyncAck(rank=0, step_count=3),
        ]
        bus.publish(_batch(4))  # the first after a report the coordinator acted on
        assert [d.msg for d in _upstream(coord, 1)] == [_batch(4)]
        bus.publish(_batch(5))
        assert _upstream(coord, 1, timeout=1.0) == []
        bus.hurry()  # the rank is about to wait on its control
        assert [d.msg for d in _upstream(coord, 1)] == [_batch(5)]
        bus.publish(_batch(6))
        beat = m.Heartbeat(rank=0, step_count=1)
        bus.publish(beat)  # a heartbeat goes at once, with what waited
        assert [d.msg for d in _upstream(coord, 2)] == [_batch(6), beat]
    finally:
        bus.close()


def test_a_message_the_wire_cannot_carry_is_dropped_loudly_and_the_stream_goes_on(
    coord: RedisCoordinatorBus, rank_bus: RankIoBus
) -> None:
    rank_bus.publish(_batch(1))
    rank_bus.publish(_batch(2**70))  # beyond any msgpack int: refused in the rank
    rank_bus.publish(_batch(-1))  # a msgpack int, not a u64: refused by the bus process
    rank_bus.publish(m.SyncAck(rank=0, step_count=3))
    assert rank_bus.flush(10.0)
    assert [d.msg for d in _upstream(coord, 2)] == [_batch(1), m.SyncAck(rank=0, step_count=3)]
    assert _upstream(coord, 1, timeout=0.5) == []


def test_control_comes_verified_in_send_order_and_a_forged_entry_is_dead_lettered(
    coord: RedisCoordinatorBus, rank_bus: RankIoBus, real_redis: redis.Redis
) -> None:
    coord.send(0, m.Checkpoint(version=1, target_rank=0))
    coord.broadcast(m.SetGlobalStep(global_step=2))
    # A writer without the rank's key adds an entry that looks like the coordinator's.
    body = entries.encode(m.Checkpoint(version=99, target_rank=0))
    real_redis.xadd(
        KEYS.ctl(0),
        {b"type": body[0], b"rank": b"0", b"seq": b"2", b"body": body[1], b"mac": b"0" * 32},
    )
    coord.send(0, m.Checkpoint(version=3, target_rank=0))
    coord.send(1, m.Checkpoint(version=4, target_rank=1))  # another rank's
    coord.broadcast(m.SetGlobalStep(global_step=5))
    got = _control(rank_bus, 4)
    assert [d.msg for d in got] == [
        m.Checkpoint(version=1, target_rank=0),
        m.SetGlobalStep(global_step=2),
        m.Checkpoint(version=3, target_rank=0),
        m.SetGlobalStep(global_step=5),
    ]
    assert rank_bus.read_control(200) == []
    dead = real_redis.xrange(KEYS.dlq_for(KEYS.ctl(0)))
    assert len(dead) == 1  # type: ignore[arg-type]
    # What the runtime took over is what its heartbeats say it read.
    ctl, bcast = rank_bus.control_read()
    assert ctl == got[2].entry_id and bcast == got[3].entry_id


def test_the_bus_process_killed_is_the_bus_lost_for_reads_and_publishes(
    rank_bus: RankIoBus,
) -> None:
    rank_bus.publish(_batch(1))
    assert rank_bus.flush(10.0)
    os.kill(rank_bus.pid, signal.SIGKILL)
    with pytest.raises(BusLost, match=r"exited \(code -9\)"):
        rank_bus.read_control(5000)
    with pytest.raises(BusError, match="bus process"):
        rank_bus.publish(_batch(2))
    assert rank_bus.flush(1.0) is False


def test_the_bus_process_outlives_stop_signals_sent_to_its_rank(
    coord: RedisCoordinatorBus, rank_bus: RankIoBus
) -> None:
    """A Ctrl-C reaches the whole process group: the rank stops in order and its last
    reports (its Exiting) must still go out through the bus process."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        os.kill(rank_bus.pid, sig)
    rank_bus.publish(m.Exiting(rank=0, reason="signal"))
    assert rank_bus.flush(10.0)
    assert [d.msg for d in _upstream(coord, 1)] == [m.Exiting(rank=0, reason="signal")]
    os.kill(rank_bus.pid, 0)  # still there


RANK = """
import sys
from flodl_bus.agent.rank_io import RankIoBus
from flodl_bus.bus.keys import RunKeys
from tests.bus.conftest import FAST, RK
bus = RankIoBus(sys.argv[1], RunKeys("rankio"), 0, RK(0), config=FAST)
print(bus.pid, flush=True)
sys.stdin.read()
"""


def test_the_bus_process_leaves_when_its_rank_dies(
    coord: RedisCoordinatorBus, redis_url: str
) -> None:
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK, redis_url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )
    assert rank.stdout is not None
    child = os.pidfd_open(int(rank.stdout.readline()))
    try:
        rank.kill()
        rank.wait(10)
        # readable once the process has exited (an event, not a poll)
        ready, _, _ = select.select([child], [], [], 60)
        assert ready, "the bus process outlived its rank"
    finally:
        os.close(child)


def test_a_bus_process_that_cannot_start_says_why(redis_url: str) -> None:
    with pytest.raises(BusError, match="did not start: BadRedisUrl: unsupported Redis URL"):
        RankIoBus("ftp://127.0.0.1:1", KEYS, 0, RK(0), config=FAST)


class CountingBus(RankIoBus):
    """Counts the control each path took: the training thread's polls, the reader's reads."""

    polled = 0
    read = 0

    def poll_control(self) -> list[Delivery]:
        got = super().poll_control()
        self.polled += len(got)
        return got

    def read_control(self, block_ms: int) -> list[Delivery]:
        got = super().read_control(block_ms)
        self.read += len(got)
        return got


def _runtime(bus: RankIoBus, timeout: float = 30.0) -> tuple[RankRuntime, Inbox]:
    inbox = Inbox()
    params = ObservedParams(digits.build_model(), rank=0)
    config = RuntimeConfig(heartbeat_interval=10.0, coord_liveness_timeout=timeout)
    runtime = RankRuntime(bus=bus, inbox=inbox, params=params, world_size=2, config=config)
    return runtime.start(), inbox


def test_a_polling_training_thread_and_the_reader_take_control_once_each_in_send_order(
    coord: RedisCoordinatorBus, redis_url: str
) -> None:
    """The training thread polls between steps and waits on its inbox now and then; the
    coordinator sends meanwhile: every entry arrives once, in send order, over both."""
    bus = CountingBus(redis_url, KEYS, 0, RK(0), config=FAST)
    runtime, inbox = _runtime(bus)
    n = 400
    sender = threading.Thread(
        target=lambda: [coord.send(0, m.Checkpoint(version=v, target_rank=0)) for v in range(n)]
    )
    got: list[int] = []
    try:
        sender.start()
        deadline = time.monotonic() + 60
        while len(got) < n and time.monotonic() < deadline:
            msg = inbox.poll() if len(got) % 50 else inbox.get(5.0)  # a step, or a wait
            if isinstance(msg, m.Checkpoint):
                got.append(msg.version)
        sender.join()
    finally:
        runtime.close()
    assert got == list(range(n))
    assert bus.polled > 0 and bus.read > 0, (bus.polled, bus.read)
    assert bus.polled + bus.read == n


def test_the_reader_takes_the_control_of_a_training_thread_that_stopped_polling(
    coord: RedisCoordinatorBus, redis_url: str
) -> None:
    """A rank away from its loop (an eval, a collective, the job's code) does not poll:
    past ``POLL_STALE_S`` its reader reads, and a message that must act at once (a peer
    declared dead aborts the collective) does."""
    bus = CountingBus(redis_url, KEYS, 0, RK(0), config=FAST)
    runtime, inbox = _runtime(bus)
    try:
        assert inbox.poll() is None  # the training thread polled once, then went away
        coord.send(0, m.Checkpoint(version=7, target_rank=0))
        coord.broadcast(m.DeclareDead(rank=1))
        deadline = time.monotonic() + 30
        while not runtime.dead_ranks and time.monotonic() < deadline:
            threading.Event().wait(0.01)  # not polling: only the reader can bring them
        assert runtime.dead_ranks == {1}
        assert len(inbox) == 1 and bus.read == 2 and bus.polled == 0
        assert ("abort", None) in runtime.params.calls  # type: ignore[attr-defined]
    finally:
        runtime.close()


def test_a_polling_rank_still_stops_when_its_coordinator_falls_silent(
    coord: RedisCoordinatorBus, redis_url: str
) -> None:
    bus = RankIoBus(redis_url, KEYS, 0, RK(0), config=FAST)
    runtime, inbox = _runtime(bus, timeout=1.0)
    try:
        deadline = time.monotonic() + 30
        msg = None
        while not isinstance(msg, m.Shutdown) and time.monotonic() < deadline:
            msg = inbox.poll()  # a training thread that keeps stepping and polling
        assert isinstance(msg, m.Shutdown)
        assert runtime.coordinator_lost.is_set()
    finally:
        runtime.close()


def test_a_bus_process_that_takes_nothing_is_killed_and_the_bus_is_lost(
    coord: RedisCoordinatorBus, redis_url: str
) -> None:
    """Stopped (or hung) rather than dead, it would let the socket fill and a publish
    wait for ever: past the stall the publish raises, the process is killed, and the
    rank's next read meets its end."""
    bus = RankIoBus(redis_url, KEYS, 0, RK(0), config=FAST, stall_s=1.0)
    try:
        os.kill(bus.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 60
        with pytest.raises(BusError, match=r"took no upstream for 1s \(stopped or hung\)"):
            while time.monotonic() < deadline:  # until the socket is full
                bus.publish(m.SyncAck(rank=0, step_count=1))
        with pytest.raises(BusLost, match=r"exited \(code -9\)"):
            bus.read_control(5000)
    finally:
        bus.close()
