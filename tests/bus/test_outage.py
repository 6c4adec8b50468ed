"""Redis outages and refused writes against a real redis-server (DESIGN §3 rule 10).

Each test starts its own server on a free loopback port, so it can kill it (SIGKILL),
restart it on the same port, or shrink its ``maxmemory`` without disturbing the other
tests. A coordinator bus and a rank bus exchange numbered messages both ways in threads
throughout; the checks are that every message arrives exactly once, in order, and that
the readers hear again within a bounded time after Redis is back.

The only sleeps are the faults themselves (the outage length); every wait for an effect
is a wait for an event (an entry arriving, a log line), bounded by a generous timeout
that only a failure reaches.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
import structlog

from flodl_bus.bus.connection import connect
from flodl_bus.bus.server import RedisServer
from flodl_bus.bus.stream_ops import StreamsConfig
from flodl_bus.bus.streams import RedisCoordinatorBus, RedisRankBus
from flodl_bus.protocol import messages as m
from tests.bus.conftest import CK, RK

pytestmark = pytest.mark.redis

#: The production reconnect policy: the time to hear again is what a run would see.
PRODUCTION = StreamsConfig()
#: Bound on "hears again after Redis is back": one backoff ceiling (2 s) plus a read's
#: BLOCK (1 s), with room for a loaded 2-core machine.
RESUME_BOUND_S = 8.0
#: Bound on any wait for an effect (only a failing test reaches it).
EVENT_TIMEOUT_S = 30.0
PACE_S = 0.01


def wait_for(cond: Callable[[], bool], what: str, timeout: float = EVENT_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def kill_server(server: RedisServer) -> None:
    """SIGKILL: no shutdown, no final AOF rewrite; what the AOF has is what survives."""
    assert server.proc is not None
    server.proc.kill()
    server.proc.wait()
    server.stop()  # reaps and closes the pipes of the dead process


def bus_pair(url: str, run: str) -> tuple[RedisCoordinatorBus, RedisRankBus]:
    """A coordinator bus and rank 0's bus on ``url``, with fixed keys of the run."""
    coord_client, rank_client = connect(url), connect(url)
    coord = RedisCoordinatorBus(coord_client, run, CK, ranks=[0], config=PRODUCTION)
    return coord, RedisRankBus(rank_client, run, 0, RK(0), config=PRODUCTION)


class Exchange:
    """A coordinator and rank 0 exchanging numbered messages both ways, in threads.

    Downstream alternates unicast (``ctl:0``) and broadcast (``ctl:all``) so both control
    streams cross the fault; upstream is the rank's publisher.
    """

    def __init__(self, url: str, run: str) -> None:
        self.coord, self.rank = bus_pair(url, run)
        self.sent_down = 0
        self.sent_up = 0
        self.down: list[tuple[float, int]] = []  # (arrival, step) at the rank
        self.up: list[tuple[float, int]] = []  # (arrival, step) at the coordinator
        self._stop_sending = threading.Event()
        self._stop_reading = threading.Event()
        self.errors: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._guard(f), daemon=True)
            for f in (self._send_down, self._send_up, self._read_down, self._read_up)
        ]

    def _guard(self, f: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                f()
            except BaseException as exc:  # surfaced by finish()
                self.errors.append(exc)

        return run

    def _send_down(self) -> None:
        while not self._stop_sending.is_set():
            msg = m.SetGlobalStep(global_step=self.sent_down)
            # Blocks through an outage (the Link retries until Redis answers).
            if self.sent_down % 2:
                self.coord.broadcast(msg)
            else:
                self.coord.send(0, msg)
            self.sent_down += 1
            time.sleep(PACE_S)

    def _send_up(self) -> None:
        while not self._stop_sending.is_set():
            # publish() only queues: it returns at once while Redis is down.
            self.rank.publish(
                m.Batch(rank=0, batch_ms=1.0, data_ms=0.1, step_count=self.sent_up, batch_loss=0.5)
            )
            self.sent_up += 1
            time.sleep(PACE_S)

    def _read_down(self) -> None:
        while not self._stop_reading.is_set():
            ds = self.rank.read_control(200)
            now = time.monotonic()
            self.down += [
                (now, d.msg.global_step) for d in ds if isinstance(d.msg, m.SetGlobalStep)
            ]
            self.rank.ack(ds)

    def _read_up(self) -> None:
        while not self._stop_reading.is_set():
            ds = self.coord.read_upstream(200)
            now = time.monotonic()
            self.up += [(now, d.msg.step_count) for d in ds if isinstance(d.msg, m.Batch)]
            self.coord.ack(ds)

    def start(self) -> Exchange:
        for t in self._threads:
            t.start()
        return self

    def first_after(self, t: float) -> tuple[float, float]:
        """When each reader first heard something after ``t`` (rank, coordinator)."""
        wait_for(
            lambda: any(a > t for a, _ in self.down) and any(a > t for a, _ in self.up),
            "both readers to hear again",
        )
        return (
            min(a for a, _ in self.down if a > t) - t,
            min(a for a, _ in self.up if a > t) - t,
        )

    def finish(self) -> tuple[list[int], list[int]]:
        """Stop sending, wait until everything sent has arrived, return the steps seen."""
        self._stop_sending.set()
        self._threads[0].join(EVENT_TIMEOUT_S)
        self._threads[1].join(EVENT_TIMEOUT_S)
        assert self.rank.flush(EVENT_TIMEOUT_S), "rank publisher did not drain"
        wait_for(
            lambda: len(self.down) >= self.sent_down and len(self.up) >= self.sent_up,
            "every sent message to arrive",
        )
        # A duplicate would arrive after the counts matched: one more quiet read each.
        self._stop_reading.set()
        for t in self._threads[2:]:
            t.join(EVENT_TIMEOUT_S)
        assert not self.errors, self.errors
        assert self.rank.read_control(50) == []
        assert self.coord.read_upstream(50) == []
        return [s for _, s in self.down], [s for _, s in self.up]

    def close(self) -> None:
        self._stop_sending.set()
        self._stop_reading.set()
        for t in self._threads:
            t.join(5.0)  # a reader ends within one BLOCK; a sender within one backoff
        self.rank.close()
        self.coord.close()


@contextmanager
def exchange(server: RedisServer, run: str) -> Iterator[Exchange]:
    ex = Exchange(server.url, run).start()
    try:
        yield ex
    finally:
        ex.close()


def events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in list(logs) if e["event"] == name]


# ------------------------------------------------------------------------ outages


@pytest.mark.parametrize("outage_s", [1.0, 3.0, 10.0])
def test_both_directions_survive_a_killed_and_restarted_redis_with_aof(outage_s: float) -> None:
    with RedisServer(appendonly=True) as server, structlog.testing.capture_logs() as logs:
        with exchange(server, f"outage{int(outage_s)}") as ex:
            wait_for(lambda: len(ex.down) > 20 and len(ex.up) > 20, "traffic before the fault")
            kill_server(server)
            time.sleep(outage_s)  # the fault itself
            server.start()
            back = time.monotonic()
            rank_s, coord_s = ex.first_after(back)
            down, up = ex.finish()
        print(
            f"\noutage {outage_s:.0f} s: rank reader heard again {rank_s:.2f} s after restart, "
            f"coordinator reader {coord_s:.2f} s; {len(down)} down, {len(up)} up"
        )
        assert down == list(range(len(down))) and len(down) == ex.sent_down
        assert up == list(range(len(up))) and len(up) == ex.sent_up
        assert rank_s < RESUME_BOUND_S and coord_s < RESUME_BOUND_S
        # One line per link when it lost Redis, one when it is back: not one per attempt.
        lost = events(logs, "redis_unreachable")
        back_lines = events(logs, "redis_reconnected")
        links = {e["link"] for e in back_lines}
        assert {"rank0.reader", "coordinator.reader"} <= links
        assert len(back_lines) == len(links) and len(lost) == len(links)


def test_a_restart_without_persistence_recreates_the_streams_and_the_run_goes_on() -> None:
    # Decision (RELIABILITY.md): Redis is soft state (DESIGN §3 rule 5), so a restart that
    # lost everything is survived like one that kept it: the coordinator's reader
    # recreates its group from the start of the (now empty) streams, a rank's reader
    # reads on from its cursor, and writers continue their ids above
    # what they wrote before. What was in flight at the restart is lost, which is why
    # ops/redis.conf ships AOF; every message sent after the restart arrives once, in
    # order, and nothing before it arrives twice.
    with RedisServer(appendonly=False) as server:
        with exchange(server, "wiped") as ex:
            wait_for(lambda: len(ex.down) > 20 and len(ex.up) > 20, "traffic before the fault")
            kill_server(server)
            sent_at_kill = (ex.sent_down, ex.sent_up)
            time.sleep(1.0)
            server.start()
            back = time.monotonic()
            rank_s, coord_s = ex.first_after(back)
            admin = connect(server.url)
            try:
                # The coordinator's group is back (recreated by its reader), on a fresh
                # stream; the rank reads its control from its own cursor, no group.
                groups = admin.xinfo_groups(ex.rank.keys.up(0))
                assert [g["name"] for g in groups] == [b"coordinator"]
            finally:
                admin.close()
            ex._stop_sending.set()
            ex._threads[0].join(EVENT_TIMEOUT_S)
            ex._threads[1].join(EVENT_TIMEOUT_S)
            assert ex.rank.flush(EVENT_TIMEOUT_S)
            sent_down, sent_up = ex.sent_down, ex.sent_up
            # Everything from the restart on arrives.
            wait_for(
                lambda: bool(ex.down) and ex.down[-1][1] == sent_down - 1,
                "the last control message",
            )
            wait_for(lambda: bool(ex.up) and ex.up[-1][1] == sent_up - 1, "the last batch")
            down = [s for _, s in ex.down]
            up = [s for _, s in ex.up]
        print(
            f"\nrestart without persistence: rank reader heard again {rank_s:.2f} s after "
            f"restart, coordinator {coord_s:.2f} s; lost in flight: "
            f"{sent_down - len(down)} down, {sent_up - len(up)} up"
        )
        for got, sent, at_kill in (
            (down, sent_down, sent_at_kill[0]),
            (up, sent_up, sent_at_kill[1]),
        ):
            assert got == sorted(set(got)), "a duplicate or a reordering"
            # Only what was in flight at the kill can be missing.
            assert set(range(at_kill + 1, sent)) <= set(got)
        assert rank_s < RESUME_BOUND_S and coord_s < RESUME_BOUND_S


# ---------------------------------------------------------------- refused writes


def test_writes_refused_for_out_of_memory_wait_and_resume_when_memory_is_freed() -> None:
    with RedisServer() as server, structlog.testing.capture_logs() as logs:
        admin = redis.Redis(host="127.0.0.1", port=server.port)
        try:
            with exchange(server, "oom") as ex:
                wait_for(lambda: len(ex.down) > 20 and len(ex.up) > 20, "traffic before")
                # Below what the server already holds: every XADD is refused with OOM
                # (noeviction), reads and acks still work.
                used = int(admin.info("memory")["used_memory"])
                admin.config_set("maxmemory", str(used // 2))
                wait_for(
                    lambda: (
                        {"coordinator.sender", "rank0.publisher"}
                        <= {e["link"] for e in events(logs, "redis_write_blocked")}
                    ),
                    "both writers to report the refusal",
                )
                blocked_at = time.monotonic()
                # Hold the episode long enough for many retries (the fault itself).
                time.sleep(2.0)
                admin.config_set("maxmemory", "0")
                freed = time.monotonic()
                rank_s, coord_s = ex.first_after(freed)
                down, up = ex.finish()
        finally:
            admin.close()
        print(
            f"\nOOM for {freed - blocked_at:.1f} s: rank reader heard again {rank_s:.2f} s "
            f"after memory was freed, coordinator {coord_s:.2f} s"
        )
        assert down == list(range(len(down))) and len(down) == ex.sent_down
        assert up == list(range(len(up))) and len(up) == ex.sent_up
        assert rank_s < RESUME_BOUND_S and coord_s < RESUME_BOUND_S
        blocked = events(logs, "redis_write_blocked")
        resumed = events(logs, "redis_write_resumed")
        # One line per writer when the episode starts and one when it ends.
        assert sorted(e["link"] for e in blocked) == sorted({e["link"] for e in blocked})
        assert sorted(e["link"] for e in resumed) == sorted(e["link"] for e in blocked)
        for e in blocked:
            assert e["kind"] == "OOM" and e["reason"].startswith("out of memory (maxmemory")
        assert all(e["blocked_s"] >= 1.0 and e["attempts"] > 1 for e in resumed)
        assert not events(logs, "bus_publisher_failed")
