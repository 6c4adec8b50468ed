"""The host agent (``flodl_bus.agent``) against a real redis-server and a real agent
process: control order per rank, no loss or duplicate across an agent restart, a killed
agent stopping its ranks, and the upstream fold keeping each rank's authenticity."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from flodl_bus.agent.rank_bus import AgentRankBus
from flodl_bus.bus import fold
from flodl_bus.bus.api import BusLost, Delivery
from flodl_bus.bus.connection import connect
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.streams import RedisCoordinatorBus
from flodl_bus.protocol import messages as m
from tests.bus.conftest import CK, FAST, RK

RUN = "agentrun"
KEYS = RunKeys(RUN)
RANKS = (0, 1, 2)


class Agent:
    """One ``python -m flodl_bus.agent`` process, ready once it printed its line."""

    def __init__(
        self,
        url: str,
        sock: str,
        ranks: tuple[int, ...] = RANKS,
        env: dict[str, str] | None = None,
    ) -> None:
        self.env = env
        self.url = url
        self.sock = sock
        self.ranks = ranks
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> Agent:
        ranks = ",".join(map(str, self.ranks))
        argv = [sys.executable, "-m", "flodl_bus.agent", "--url", self.url, "--run", RUN]
        argv += ["--host", "h0", "--ranks", ranks, "--socket", self.sock]
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            text=True,
            env=self.env or os.environ.copy(),
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # waits on the event, not a sleep
        assert "ready" in line, line
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture
def sock() -> Iterator[str]:
    # A short path: a Unix socket's name is limited to ~100 bytes.
    with tempfile.TemporaryDirectory(prefix="fa") as d:
        yield str(Path(d) / "agent.sock")


@pytest.fixture
def coord(
    real_redis: redis.Redis, redis_url: str, request: pytest.FixtureRequest
) -> Iterator[RedisCoordinatorBus]:
    """The coordinator's bus, reading the fold on its own thread, or (``indirect``
    parameter 1) in a reader process (``bus.ingest``)."""
    procs = getattr(request, "param", 0)
    bus = RedisCoordinatorBus(connect(redis_url), KEYS, CK, config=FAST, ingest_procs=procs)
    bus.add_fold("h0", RANKS)
    for r in RANKS:
        bus.add_rank(r)
    if bus.ingest is not None:
        assert bus.ingest.wait_ready(60)
    yield bus
    bus.close()


def _value(msg: object) -> int:
    if isinstance(msg, m.Checkpoint):
        return msg.version
    assert isinstance(msg, m.SetGlobalStep), msg
    return msg.global_step


def _read(bus: AgentRankBus, want: int, got: list[int], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        ds = bus.read_control(100)
        bus.ack(ds)
        got += [_value(d.msg) for d in ds]


def _send_round(coord: RedisCoordinatorBus, start: int, n: int, sent: dict[int, list[int]]) -> int:
    """``n`` messages, unicasts to each rank in turn interleaved with broadcasts, each
    carrying the next value of one counter (the send order)."""
    c = start
    for i in range(n):
        c += 1
        if i % 3 == 2:
            coord.broadcast(m.SetGlobalStep(global_step=c))
            for r in RANKS:
                sent[r].append(c)
        else:
            r = RANKS[i % len(RANKS)]
            coord.send(r, m.Checkpoint(version=c, target_rank=r))
            sent[r].append(c)
    return c


def test_control_order_no_loss_no_dup_across_agent_kill_and_restart(
    coord: RedisCoordinatorBus, redis_url: str, sock: str
) -> None:
    agent = Agent(redis_url, sock).start()
    buses = {r: AgentRankBus(sock, KEYS, r, RK(r), config=FAST, grace_s=60.0) for r in RANKS}
    try:
        sent: dict[int, list[int]] = {r: [] for r in RANKS}
        got: dict[int, list[int]] = {r: [] for r in RANKS}
        c = _send_round(coord, 0, 60, sent)
        for r in RANKS:
            # rank 2 reads only part before the kill: it has entries in flight
            _read(buses[r], len(sent[r]) // (2 if r == 2 else 1), got[r])
        agent.kill()
        # sent while no agent runs: the new one must hand them over, once each
        c = _send_round(coord, c, 60, sent)
        agent = Agent(redis_url, sock).start()
        c = _send_round(coord, c, 60, sent)
        for r in RANKS:
            _read(buses[r], len(sent[r]), got[r])
            assert got[r] == sent[r], f"rank {r}"
            assert buses[r].reconnects >= 1
        # nothing more arrives (no duplicate delivered late)
        for r in RANKS:
            assert buses[r].read_control(200) == []
    finally:
        for b in buses.values():
            b.close()
        agent.stop()


def test_a_killed_agent_stops_its_ranks(
    coord: RedisCoordinatorBus, redis_url: str, sock: str
) -> None:
    from flodl_bus.worker.inbox import CLOSED, Inbox
    from flodl_bus.worker.runtime import RankRuntime, RuntimeConfig
    from tests.worker.test_control import ListParams

    agent = Agent(redis_url, sock).start()
    bus = AgentRankBus(sock, KEYS, 0, RK(0), config=FAST, grace_s=0.5)
    runtime = RankRuntime(
        bus=bus,
        inbox=Inbox(),
        params=ListParams(),  # type: ignore[arg-type]
        world_size=3,
        config=RuntimeConfig(heartbeat_interval=0.05, read_block_ms=50),
    ).start()
    try:
        # the rank is alive through the agent: its heartbeats reach the coordinator
        deadline = time.monotonic() + 60
        beats: list[Delivery] = []
        while not beats and time.monotonic() < deadline:
            beats = [d for d in coord.read_upstream(100) if isinstance(d.msg, m.Heartbeat)]
        assert beats and beats[0].stream == KEYS.up(0)
        agent.kill()
        assert runtime.coordinator_lost.wait(60), "the rank did not stop"
        assert bus.lost is not None
        with pytest.raises(BusLost):
            bus.read_control(10)
        # the training thread is told to stop (in order: a Shutdown after what it had)
        told: list[object] = []
        while (msg := runtime.inbox.get(timeout=10.0)) not in (CLOSED, None):
            told.append(msg)
        assert msg is CLOSED
        assert told and isinstance(told[-1], m.Shutdown)
    finally:
        runtime.close(flush_timeout=0.1)
        agent.stop()


def _batch(rank: int, i: int) -> m.Batch:
    return m.Batch(rank=rank, batch_ms=1.0, data_ms=0.1, step_count=i, batch_loss=0.5)


def _collect_up(coord: RedisCoordinatorBus, want: int, timeout: float = 60.0) -> list[Delivery]:
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        ds = coord.read_upstream(100)
        coord.ack(ds)
        got += ds
    return got


def _dlq_reasons(client: redis.Redis) -> list[str]:
    return [f[b"reason"].decode() for _, f in client.xrange(KEYS.dlq)]  # type: ignore[union-attr]


@pytest.mark.parametrize("coord", [0, 1], indirect=True, ids=["in-thread", "reader-process"])
def test_upstream_fold_keeps_order_and_applies_once_across_an_agent_kill(
    coord: RedisCoordinatorBus, real_redis: redis.Redis, redis_url: str, sock: str
) -> None:
    agent = Agent(redis_url, sock).start()
    buses = {r: AgentRankBus(sock, KEYS, r, RK(r), config=FAST, grace_s=60.0) for r in RANKS}
    n = 300
    try:
        for i in range(1, n + 1):
            for r in RANKS:
                buses[r].publish(_batch(r, i))
            if i == n // 2:
                # killed with frames in flight: some written and not acked, some not
                # written; the ranks send every unacked frame again to the new agent
                agent.kill()
                agent = Agent(redis_url, sock).start()
        for r in RANKS:
            assert buses[r].flush(60.0)
        got = _collect_up(coord, n * len(RANKS))
        assert coord.read_upstream(200) == []  # nothing late: applied once each
        for r in RANKS:
            steps = [d.msg.step_count for d in got if d.stream == KEYS.up(r)]  # type: ignore[attr-defined]
            assert steps == list(range(1, n + 1)), f"rank {r}"
        # the coordinator read the host's one stream, never the ranks' own
        assert not any(real_redis.exists(KEYS.up(r)) for r in RANKS)
        assert real_redis.xlen(fold.host_stream(KEYS.prefix, "h0")) > 0
        # an item written by the first agent and sent again is refused as a replay
        assert all(w.startswith("folded item") for w in _dlq_reasons(real_redis))
    finally:
        for b in buses.values():
            b.close()
        agent.stop()


def test_forged_folded_items_are_dead_lettered_alone(
    coord: RedisCoordinatorBus, real_redis: redis.Redis
) -> None:
    """What an agent (or anyone with the worker's XADD right on ``up:*``) could write:
    the good item of an entry is delivered, each forged one dead-lettered with why."""
    from flodl_bus.bus import entries

    coord.add_rank(5)  # a rank of the run, but not of host h0
    stream = fold.host_stream(KEYS.prefix, "h0")

    def item(rank: int, seq: int, msg: object, key_of: int | None = None) -> list[object]:
        key = RK(rank if key_of is None else key_of).rank_key
        return fold.sign_item(key, KEYS.up(rank), rank, seq, entries.encode(msg))

    good = item(0, 1, _batch(0, 1))
    altered = item(1, 1, _batch(1, 1))
    altered[3] = entries.encode(_batch(1, 99))[1]  # the agent changed the body
    spoofed = item(2, 1, _batch(2, 1), key_of=1)  # rank 1 signing as rank 2
    other_host = item(5, 1, _batch(5, 1))  # rank 5's own, through the wrong host
    as_direct = item(1, 2, _batch(1, 2))
    real_redis.xadd(stream, fold.fold_fields("h0", 1, [good, altered, spoofed, other_host]))
    real_redis.xadd(stream, fold.fold_fields("h0", 2, [good, as_direct]))  # good replayed
    bad = fold.fold_fields("h0", 3, [item(0, 2, _batch(0, 2))])
    bad[b"body"] = bad[b"body"][:-1] + b"\x00"  # the folded body altered, digest kept
    real_redis.xadd(stream, bad)  # type: ignore[arg-type]
    got = _collect_up(coord, 2, timeout=5.0)
    assert [(d.stream, d.msg) for d in got] == [
        (KEYS.up(0), _batch(0, 1)),
        (KEYS.up(1), _batch(1, 2)),
    ]
    reasons = _dlq_reasons(real_redis)
    assert len(reasons) == 5, reasons

    def one(*parts: str) -> None:
        assert sum(all(p in r for p in parts) for r in reasons) == 1, (parts, reasons)

    one("bad digest")
    one("authentication failed", KEYS.up(1))
    one("authentication failed", KEYS.up(2))
    one("not a rank this host serves", "rank 5")
    one("replayed", KEYS.up(0))


def test_a_folded_item_never_verifies_as_a_direct_entry() -> None:
    from flodl_bus.bus import entries
    from flodl_bus.protocol import wire

    _, _, type_, body, mac = fold.sign_item(
        RK(0).rank_key, KEYS.up(0), 0, 1, entries.encode(_batch(0, 1))
    )
    fields = {b"type": type_, b"rank": b"0", b"seq": b"1", b"body": body, b"mac": mac}
    for eid in (b"1-1", b"0-1", fold.FOLD_ID + b"-0"):
        got = entries.parse(
            RK(0).rank_key, KEYS.up(0), eid, fields, channel=wire.UPSTREAM, rank="0"
        )
        assert isinstance(got, str) and "authentication failed" in got
    ok = entries.parse(
        RK(0).rank_key, KEYS.up(0), fold.FOLD_ID, fields, channel=wire.UPSTREAM, rank="0"
    )
    assert isinstance(ok, entries.Parsed) and ok.msg == _batch(0, 1)
    # and bound to its own stream: rank 0's item is not rank 0's on another run
    other = entries.parse(
        RK(0).rank_key, RunKeys("other").up(0), fold.FOLD_ID, fields,
        channel=wire.UPSTREAM, rank="0",
    )  # fmt: skip
    assert isinstance(other, str)


def test_the_agent_runs_under_its_least_rights_user(
    coord: RedisCoordinatorBus, real_redis: redis.Redis, redis_url: str, sock: str
) -> None:
    """Control and fold work through ``flodl-RUN-agent``; everything else is refused."""
    from flodl_bus.agent.acl import agent_rules, agent_user

    info: dict[str, str] = real_redis.info("server")  # type: ignore[assignment]
    setinfo = tuple(int(x) for x in info["redis_version"].split(".")[:2]) >= (7, 2)
    name = agent_user(RUN)
    real_redis.execute_command(
        "ACL",
        "SETUSER",
        name,
        "reset",
        "on",
        ">agent-pw",
        *agent_rules(RUN, client_setinfo=setinfo),
    )
    env = {**os.environ, "FLODL_REDIS_USERNAME": name, "FLODL_REDIS_PASSWORD": "agent-pw"}
    as_agent = redis.Redis.from_url(redis_url, username=name, password="agent-pw")
    agent = Agent(redis_url, sock, env=env).start()
    bus = AgentRankBus(sock, KEYS, 0, RK(0), config=FAST, grace_s=60.0)
    try:
        coord.send(0, m.Checkpoint(version=7, target_rank=0))
        coord.broadcast(m.SetGlobalStep(global_step=8))
        got: list[int] = []
        _read(bus, 2, got)
        assert got == [7, 8]
        bus.publish(_batch(0, 1))
        assert bus.flush(60.0)
        ups = _collect_up(coord, 1)
        assert [d.msg for d in ups] == [_batch(0, 1)]
        # it was the agent's user that read and wrote (the server's client list says;
        # as_agent has not connected yet)
        clients = real_redis.client_list()
        assert any(c.get("user") == name for c in clients)
        refused = [
            lambda: as_agent.xadd(KEYS.ctl(0), {"type": "x"}),
            lambda: as_agent.xadd(KEYS.ctl_all, {"type": "x"}),
            lambda: as_agent.xadd(KEYS.up(0), {"type": "x"}),
            lambda: as_agent.get(KEYS.secret),
            lambda: as_agent.xadd(KEYS.join, {"type": "x"}),
            lambda: as_agent.set(KEYS.store("k"), "1"),
            lambda: as_agent.xrange(KEYS.dlq),
            lambda: as_agent.xtrim(fold.host_stream(KEYS.prefix, "h0"), maxlen=0),
            lambda: as_agent.xgroup_create(KEYS.ctl(0), "g", id="0"),
            lambda: as_agent.xrange(RunKeys("otherrun").ctl(0)),
        ]
        for op in refused:
            with pytest.raises(redis.exceptions.NoPermissionError):
                op()
    finally:
        bus.close()
        agent.stop()
        as_agent.close()
        real_redis.execute_command("ACL", "DELUSER", name)


def test_a_rank_that_stops_reading_holds_up_no_other_rank(
    coord: RedisCoordinatorBus, redis_url: str, sock: str
) -> None:
    """Rank 1 says hello and never reads its socket: once its buffer is full, a send to
    it must not block the agent's delivery to rank 0."""
    import socket as socketlib

    from flodl_bus.agent import frames

    agent = Agent(redis_url, sock).start()
    stuck = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    stuck.connect(sock)
    frames.send(stuck, {"op": "hello", "rank": 1, "pos": {}})
    bus = AgentRankBus(sock, KEYS, 0, RK(0), config=FAST, grace_s=60.0)
    try:
        n = 2000  # some 500 kB of frames for rank 1: past what a Unix socket buffers
        coord.send_batch([(None, m.SetGlobalStep(global_step=i)) for i in range(1, n + 1)])
        got: list[int] = []
        _read(bus, n, got)
        assert got == list(range(1, n + 1))
    finally:
        bus.close()
        stuck.close()
        agent.stop()


def test_a_rank_refuses_control_its_agent_altered_or_misrouted(
    coord: RedisCoordinatorBus, real_redis: redis.Redis, sock: str
) -> None:
    """A malicious agent (a plain socket server here) hands rank 0 a real entry with its
    body changed, rank 1's unicast as if it were rank 0's, and a broadcast under another
    id: the rank delivers only the untouched entry and dead-letters the rest through the
    agent."""
    import socket as socketlib

    from flodl_bus.agent import frames
    from flodl_bus.bus import entries

    coord.send(0, m.Checkpoint(version=1, target_rank=0))
    coord.send(1, m.Checkpoint(version=2, target_rank=1))
    coord.broadcast(m.SetGlobalStep(global_step=3))
    coord.send(0, m.Checkpoint(version=4, target_rank=0))

    def flat(stream: str) -> list[tuple[str, list[bytes]]]:
        return [
            (eid.decode(), [x for kv in f.items() for x in kv])
            for eid, f in real_redis.xrange(stream)  # type: ignore[union-attr]
        ]

    (e1, f1), (e4, f4) = flat(KEYS.ctl(0))
    ((e2, f2),) = flat(KEYS.ctl(1))
    ((e3, f3),) = flat(KEYS.ctl_all)
    altered = list(f1)
    altered[altered.index(entries.F_BODY) + 1] = entries.encode(
        m.Checkpoint(version=99, target_rank=0)
    )[1]
    late = f"{int(e3.split('-')[0]) + 1}-0"  # the broadcast re-added under a later id
    srv = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    srv.bind(sock)
    srv.listen(1)
    bus = AgentRankBus(sock, KEYS, 0, RK(0), config=FAST, grace_s=60.0)
    conn, _ = srv.accept()
    try:
        reader = frames.FrameReader(conn)
        assert reader.read()["op"] == "hello"
        bad = [[KEYS.ctl(0), e1, altered], [KEYS.ctl(0), e2, f2], [KEYS.ctl_all, late, f3]]
        frames.send(conn, {"op": "ctl", "entries": [*bad, [KEYS.ctl(0), e4, f4]]})
        got: list[int] = []
        _read(bus, 1, got)
        assert got == [4]
        assert bus.read_control(100) == []
        dead = [reader.read() for _ in range(3)]
        assert [f["op"] for f in dead] == ["dlq"] * 3
        reasons = [dict(zip(f["fields"][::2], f["fields"][1::2]))[b"reason"] for f in dead]
        assert all(b"authentication failed" in r for r in reasons), reasons
    finally:
        bus.close()
        conn.close()
        srv.close()


def test_a_foreign_entry_at_the_maximum_id_wedges_no_rank_behind_the_agent(
    coord: RedisCoordinatorBus, real_redis: redis.Redis, redis_url: str, sock: str
) -> None:
    agent = Agent(redis_url, sock).start()
    bus = AgentRankBus(sock, KEYS, 0, RK(0), config=FAST, grace_s=60.0)
    try:
        coord.broadcast(m.SetGlobalStep(global_step=1))
        got: list[int] = []
        _read(bus, 1, got)
        real_redis.xadd(KEYS.ctl_all, {"type": "SetGlobalStep"}, id=f"{2**64 - 1}-{2**64 - 1}")
        # the agent names it once in the dlq and stays below it
        assert real_redis.xread({KEYS.dlq: "0"}, count=1, block=30_000)
        assert any("beyond any the run writes" in r for r in _dlq_reasons(real_redis))
        # the coordinator removes it on its next write; the rank reads on
        coord.broadcast(m.SetGlobalStep(global_step=2))
        coord.send(0, m.Checkpoint(version=3, target_rank=0))
        _read(bus, 3, got)
        assert got == [1, 2, 3]
    finally:
        bus.close()
        agent.stop()
