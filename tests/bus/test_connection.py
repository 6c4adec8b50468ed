"""URLs, credentials, redaction, timeouts, and the reconnect policy."""

from __future__ import annotations

import threading
from collections.abc import Callable

import fakeredis
import pytest
import redis
import structlog

from flodl_bus.bus.connection import (
    Backoff,
    BadRedisUrl,
    BusUnavailable,
    Link,
    connect,
    parse_url,
    redact_url,
    transient_kind,
)
from tests.bus.conftest import fake_client


def test_urls_give_host_port_db_and_credentials() -> None:
    t = parse_url("redis://alice:s%40cret@db.example:6390/3", env={})
    assert (t.scheme, t.host, t.port, t.db) == ("redis", "db.example", 6390, 3)
    assert (t.username, t.password) == ("alice", "s@cret")
    assert "s@cret" not in repr(t) and "cret" not in t.redacted
    assert parse_url("redis://h", env={}).port == 6379
    u = parse_url("unix:///run/redis.sock?db=2", env={})
    assert (u.path, u.db, u.host) == ("/run/redis.sock", 2, None)
    s = parse_url("rediss://h:6380/0?ssl_cert_reqs=none&ssl_ca_certs=/ca.pem", env={})
    assert s.scheme == "rediss" and dict(s.ssl_options)["ssl_cert_reqs"] == "none"


def test_credentials_come_from_the_environment_when_the_url_has_none() -> None:
    env = {"FLODL_REDIS_USERNAME": "worker", "FLODL_REDIS_PASSWORD": "pw"}
    t = parse_url("redis://h:1/0", env=env)
    assert (t.username, t.password) == ("worker", "pw")
    assert parse_url("redis://me:mine@h:1/0", env=env).password == "mine"


@pytest.mark.parametrize(
    "bad", ["http://h", "redis://", "unix://", "redis://h/x", "redis://h?ssl_cert_reqs=none"]
)
def test_bad_urls_are_refused_clearly(bad: str) -> None:
    with pytest.raises(BadRedisUrl):
        parse_url(bad, env={})


def test_redaction_hides_passwords_everywhere() -> None:
    assert redact_url("redis://u:hunter2@h:1/0") == "redis://u:***@h:1/0"
    assert redact_url("rediss://:hunter2@h") == "rediss://:***@h"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
    assert redact_url("not a url :hunter2@") == "not a url :hunter2@"  # no scheme: untouched
    with pytest.raises(BadRedisUrl) as err:
        parse_url("ftp://u:hunter2@h", env={})
    assert "hunter2" not in str(err.value)


def test_clients_have_an_explicit_socket_timeout_and_no_silent_retries() -> None:
    client = connect("redis://127.0.0.1:1/0")
    kw = client.connection_pool.connection_kwargs
    assert kw["socket_timeout"] == 10.0
    assert kw["retry"].get_retries() == 0
    with pytest.raises(ValueError, match="socket_timeout"):
        connect("redis://127.0.0.1:1/0", socket_timeout=1.0)


def test_reconnect_backs_off_exponentially_and_logs_one_line_per_reconnect() -> None:
    server = fakeredis.FakeServer()
    client = fake_client(server)
    sleeps: list[float] = []
    lost = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        if len(sleeps) == 4:
            server.connected = True  # back after the 4th wait

    link = Link(
        client,
        name="t",
        where=redact_url("redis://u:hunter2@h:1/0"),
        backoff=Backoff(base_s=0.01, factor=2.0, cap_s=0.05),
        sleep=sleep,
        on_lost=lambda: lost.append(1),
        rand=lambda: 0.0,  # the ceiling of each jittered wait
    )
    server.connected = False
    with structlog.testing.capture_logs() as logs:
        assert link.call(lambda retry: (retry, client.ping())) == (True, True)
        server.connected = False
        sleeps.clear()
        link.call(lambda retry: client.ping())
    assert sleeps[:4] == [0.01, 0.02, 0.04, 0.05]  # capped
    events = [e["event"] for e in logs]
    # One line when the connection is lost, one when it is back: never one per attempt.
    assert events == ["redis_unreachable", "redis_reconnected"] * 2
    lines = [e for e in logs if e["event"] == "redis_reconnected"]
    assert len(lost) == 2
    assert lines[0]["attempts"] == 4 and lines[0]["link"] == "t"
    assert "hunter2" not in repr(logs)


def test_backoff_is_jittered_below_its_ceiling() -> None:
    b = Backoff(base_s=0.1, factor=2.0, cap_s=1.0, jitter=0.5)
    assert [b.delay(a) for a in range(5)] == [0.1, 0.2, 0.4, 0.8, 1.0]
    assert b.jittered(3, 0.0) == 0.8 and b.jittered(3, 0.999) == pytest.approx(0.4, abs=1e-3)
    assert b.jittered(100, 0.5) == 0.75


class FakeClock:
    """Time that moves only when the link sleeps: deadlines without real waiting."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        assert s >= 0
        self.sleeps.append(s)
        self.now += s


def test_a_deadline_shorter_than_the_backoff_still_tries_every_call() -> None:
    # The bug of issue 15: with the backoff grown past a reader's 1 s deadline the link
    # slept to the deadline and gave up without a PING, and the backoff kept growing,
    # so a reader never noticed that Redis was back.
    server = fakeredis.FakeServer()
    client = fake_client(server)
    clock = FakeClock()
    pings = []

    class Counting(type(client)):  # type: ignore[misc]
        def ping(self, **kw: object) -> bool:
            pings.append(clock.now)
            return bool(super().ping(**kw))

    counting = Counting(connection_pool=client.connection_pool)
    link = Link(
        counting,
        name="reader",
        backoff=Backoff(base_s=0.05, cap_s=8.0),
        sleep=clock.sleep,
        clock=clock,
        rand=lambda: 0.0,
    )
    server.connected = False
    for _ in range(30):  # 30 reads of 1 s each while Redis is down
        with pytest.raises(BusUnavailable):
            link.call(lambda retry: counting.xread({"s": "$"}, block=1000), deadline=clock() + 1.0)
    assert max(clock.sleeps) <= 1.0 + 1e-9  # never slept past a deadline
    # Every call tried at least once.
    assert len(pings) >= 30
    server.connected = True
    back = clock()
    with structlog.testing.capture_logs() as logs:
        assert link.call(lambda retry: counting.ping(), deadline=clock() + 1.0)
    assert clock() - back <= 1.0  # heard again within one read's deadline
    assert [e["event"] for e in logs] == ["redis_reconnected"]


def test_a_deadline_gives_up_waiting_but_keeps_the_backoff_position() -> None:
    server = fakeredis.FakeServer()
    client = fake_client(server)
    link = Link(client, name="t", backoff=Backoff(base_s=0.01, cap_s=0.02))
    server.connected = False
    import time

    with pytest.raises(BusUnavailable):
        link.call(lambda retry: client.ping(), deadline=time.monotonic() + 0.05)
    assert link.is_down
    server.connected = True
    with structlog.testing.capture_logs() as logs:
        assert link.call(lambda retry: client.ping())
    assert [e["event"] for e in logs] == ["redis_reconnected"]


def test_transient_write_refusals_are_classified() -> None:
    e = redis.exceptions
    assert transient_kind(e.OutOfMemoryError("command not allowed")) == "OOM"
    assert transient_kind(e.ReadOnlyError("You can't write against a read only replica.")) == (
        "READONLY"
    )
    assert transient_kind(e.MasterDownError("Link with MASTER is down")) == "MASTERDOWN"
    assert transient_kind(e.ResponseError("BUSY Redis is busy running a script.")) == "BUSY"
    assert transient_kind(e.ResponseError("MISCONF Redis is configured to save")) == "MISCONF"
    piped = e.ResponseError("Command # 2 (EVALSHA x) of pipeline caused error: BUSY Redis is")
    assert transient_kind(piped) == "BUSY"
    # EXEC refused whole: the server filled up after the transaction's commands queued
    aborted = e.ExecAbortError("Transaction discarded because of: OOM command not allowed")
    assert transient_kind(aborted) == "OOM"
    assert (
        transient_kind(e.ExecAbortError("Transaction discarded because of previous errors."))
        is None
    )
    for permanent in (
        e.ResponseError("BUSYGROUP Consumer Group name already exists"),
        e.ResponseError("NOGROUP No such key"),
        e.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
        e.NoPermissionError("this user has no permissions"),
        e.ResponseError("ERR The ID specified in XADD is equal or smaller"),
    ):
        assert transient_kind(permanent) is None, permanent


def test_a_transient_refusal_is_retried_with_one_line_per_episode() -> None:
    clock = FakeClock()
    link = Link(
        fakeredis.FakeRedis(),
        name="w",
        backoff=Backoff(base_s=0.05, cap_s=1.0),
        sleep=clock.sleep,
        clock=clock,
    )
    calls: list[bool] = []
    refusals = iter([True] * 12 + [False] + [True] * 2 + [False])

    def op(retry: bool) -> int:
        calls.append(retry)
        if next(refusals):
            raise redis.exceptions.OutOfMemoryError(
                "command not allowed when used memory > 'maxmemory'."
            )
        return len(calls)

    with structlog.testing.capture_logs() as logs:
        assert link.call(op) == 13
        assert link.blocked is None
        with pytest.raises(BusUnavailable):  # a deadline bounds the call, not the episode
            link.call(op, deadline=clock() + 0.01)
        assert link.blocked == "OOM"
        assert link.call(op) == 16
    assert calls[0] is False and all(calls[1:13])
    assert [e["event"] for e in logs] == [
        "redis_write_blocked",
        "redis_write_resumed",
        "redis_write_blocked",
        "redis_write_resumed",
    ]
    assert logs[0]["reason"].startswith("out of memory") and logs[0]["kind"] == "OOM"
    assert logs[1]["attempts"] == 12 and logs[1]["blocked_s"] > 0
    assert link.write_blocks == 2
    # Waits grow and stay under the ceiling.
    assert max(clock.sleeps) <= 1.0 and clock.sleeps[3] > clock.sleeps[0]


@pytest.mark.redis
def test_a_killed_connection_is_reconnected_and_the_operation_rerun(redis_url: str) -> None:
    client = connect(redis_url)
    admin = connect(redis_url)
    link = Link(client, name="k", where=redact_url(redis_url), backoff=Backoff(base_s=0.001))
    client.client_setname("victim")
    calls = []

    def op(retry: bool) -> bool:
        calls.append(retry)
        if not retry:
            # Kill while a blocking read is in flight (an idle pooled connection that
            # died is replaced by redis-py before anything is sent, which is harmless).
            kill = threading.Timer(
                0.1, admin.execute_command, ("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            )
            kill.start()
        client.xread({"nothing-here": "$"}, block=500)
        return True

    with structlog.testing.capture_logs() as logs:
        assert link.call(op)
    assert calls == [False, True]
    assert sum(e["event"] == "redis_reconnected" for e in logs) == 1
    with pytest.raises(redis.exceptions.ResponseError):
        link.call(lambda retry: client.execute_command("NOSUCHCOMMAND"))  # not retried
    client.close()
    admin.close()


def _lost_once() -> Callable[[bool], bool]:
    """An op whose first call loses its connection; it returns whether it was a retry."""
    first = [True]

    def op(retry: bool) -> bool:
        if first.pop() if first else False:
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        return retry

    return op


def test_a_busy_script_refusing_the_reconnect_ping_is_waited_out_not_fatal() -> None:
    # The observer user could run EVAL_RO: a busy script makes every command, PING
    # included, answer BUSY; the process must wait, as for any refusal (issue 28).
    clock = FakeClock()
    client = fake_client(fakeredis.FakeServer())
    busy = iter([True] * 4 + [False] * 100)

    class Busy(type(client)):  # type: ignore[misc]
        def ping(self, **kw: object) -> bool:
            if next(busy):
                raise redis.exceptions.ResponseError("BUSY Redis is busy running a script.")
            return bool(super().ping(**kw))

    link = Link(
        Busy(connection_pool=client.connection_pool), name="r", sleep=clock.sleep, clock=clock
    )
    op = _lost_once()
    with structlog.testing.capture_logs() as logs:
        assert link.call(op) is True
    assert [e["event"] for e in logs] == ["redis_unreachable", "redis_reconnected"]
    assert "BUSY" in logs[1]["error"]


@pytest.mark.redis
def test_a_transaction_refused_whole_by_a_server_that_filled_up_is_retried(
    redis_url: str,
) -> None:
    client = redis.Redis.from_url(redis_url)
    admin = redis.Redis.from_url(redis_url)
    key = "conn-execabort"
    old = admin.config_get("maxmemory")["maxmemory"]
    link = Link(client, name="w", backoff=Backoff(base_s=0.001, cap_s=0.01))
    tries: list[bool] = []

    def op(retry: bool) -> object:
        tries.append(retry)
        if len(tries) == 3:  # the episode passes (the second try is refused at queuing)
            admin.config_set("maxmemory", old)
        conn = client.connection_pool.get_connection()
        try:
            conn.send_command("MULTI")
            conn.read_response()
            conn.send_command("XADD", key, "*", "a", "1")
            conn.read_response()
            if len(tries) == 1:  # full after the command queued: EXEC is refused whole
                admin.config_set("maxmemory", "1")
            conn.send_command("EXEC")
            return conn.read_response()
        except BaseException:
            conn.disconnect()  # never hand back a connection left inside MULTI
            raise
        finally:
            client.connection_pool.release(conn)

    try:
        with structlog.testing.capture_logs() as logs:
            link.call(op)
    finally:
        admin.config_set("maxmemory", old)
    assert tries[0] is False and len(tries) >= 3 and all(tries[1:])
    assert admin.xlen(key) == 1
    assert [e["kind"] for e in logs if e["event"] == "redis_write_blocked"] == ["OOM"]
    admin.delete(key)


def test_a_server_still_loading_its_data_is_waited_for_as_part_of_the_outage() -> None:
    # After a restart Redis answers LOADING until its AOF is read back; redis-py raises
    # BusyLoadingError (a ConnectionError): the same episode, one line at each end.
    clock = FakeClock()
    server = fakeredis.FakeServer()
    client = fake_client(server)
    loading = iter([True] * 5 + [False] * 100)

    class Loading(type(client)):  # type: ignore[misc]
        def ping(self, **kw: object) -> bool:
            if next(loading):
                raise redis.exceptions.BusyLoadingError("Redis is loading the dataset in memory")
            return bool(super().ping(**kw))

    loader = Loading(connection_pool=client.connection_pool)
    link = Link(loader, name="r", sleep=clock.sleep, clock=clock)
    op = _lost_once()
    with structlog.testing.capture_logs() as logs:
        assert link.call(op) is True
    assert [e["event"] for e in logs] == ["redis_unreachable", "redis_reconnected"]
    assert logs[1]["attempts"] == 6 and "BusyLoadingError" in logs[1]["error"]
