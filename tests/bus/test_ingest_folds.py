"""Host agents' fold streams read by reader processes (``bus.ingest`` with ``bus.fold``)
against a real redis-server: each item reaches the core once, in its rank's order, as
from its rank's own stream; a forged or replayed item is dead-lettered alone; a reader
killed mid-stream loses and repeats nothing, and the ranks' seqs survive it; a reader
that keeps dying hands the fold to the coordinator's thread as it was."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from typing import Any

import pytest
import structlog

from flodl_bus.bus import entries, fold, ingest
from flodl_bus.bus.api import Delivery
from flodl_bus.bus.connection import connect
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.streams import COORDINATOR_GROUP, RedisCoordinatorBus
from flodl_bus.protocol import messages as m
from flodl_bus.protocol.signing import fixed_keys
from tests.bus.conftest import CK, FAST
from tests.bus.test_ingest import kill_until_in_thread
from tests.bus.test_streams import collect_up

pytestmark = pytest.mark.redis

K = 2
HOSTS = {"h0": [0, 1, 2], "h1": [3, 4, 5]}
RANKS = [r for ranks in HOSTS.values() for r in ranks]


def _coord(url: str, keys: RunKeys, procs: int = K) -> RedisCoordinatorBus:
    coord = RedisCoordinatorBus(connect(url), keys, CK, config=FAST, ingest_procs=procs)
    for host, ranks in HOSTS.items():
        coord.add_fold(host, ranks)
    for r in RANKS:
        coord.add_rank(r)
    assert coord.ingest is not None and coord.ingest.wait_ready(60)
    return coord


class Agent:
    """What a host agent writes: one fold entry per step of its ranks' Batches, each
    item signed by its rank (``fold.sign_item``); the agent holds no rank key."""

    def __init__(self, url: str, keys: RunKeys, host: str) -> None:
        self.client = connect(url)
        self.keys = keys
        self.stream = fold.host_stream(keys.prefix, host)
        self.ranks = HOSTS[host]
        self.seqs = dict.fromkeys(self.ranks, 0)
        self.n = 0
        self.items: list[list[Any]] = []  # every good item written, for replays

    def item(self, rank: int, step: int, seq: int | None = None, key: Any = None) -> list[Any]:
        msg = m.Batch(rank=rank, batch_ms=1.0, data_ms=0.1, step_count=step, batch_loss=0.5)
        if seq is None:
            self.seqs[rank] += 1
            seq = self.seqs[rank]
        signer = (key or CK).rank(rank)
        return fold.sign_item(signer, self.keys.up(rank), rank, seq, entries.encode(msg))

    def write(self, items: list[list[Any]]) -> str:
        self.n += 1
        eid = f"{int(time.time() * 1000)}-{self.n}"
        self.client.xadd(self.stream, fold.fold_fields("x", self.n, items), id=eid)  # type: ignore[arg-type]
        return eid

    def steps(self, first: int, n: int) -> None:
        pipe = self.client.pipeline(transaction=False)
        for step in range(first, first + n):
            items = [self.item(r, step) for r in self.ranks]
            self.items += items
            self.n += 1
            eid = f"{int(time.time() * 1000)}-{self.n}"
            pipe.xadd(self.stream, fold.fold_fields("x", self.n, items), id=eid)  # type: ignore[arg-type]
        pipe.execute()


def _drain(coord: RedisCoordinatorBus, n: int) -> list[Delivery]:
    return collect_up(coord, n, timeout=60.0)


def _steps_by_rank(got: Sequence[Delivery], keys: RunKeys) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in got:
        assert isinstance(d.msg, m.Batch), d
        assert d.stream == keys.up(d.msg.rank)  # as from the rank's own stream
        out.setdefault(d.msg.rank, []).append(d.msg.step_count)
    return out


def _fold_pending(url: str, keys: RunKeys, timeout: float = 20.0) -> int:
    """The fold entries not yet acked (acks ride on each reader's next read)."""
    client = connect(url)
    streams = [fold.host_stream(keys.prefix, h) for h in HOSTS]
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = sum(int(client.xpending(s, COORDINATOR_GROUP)["pending"]) for s in streams)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.05)
    finally:
        client.close()


def test_folded_items_reach_the_core_once_in_order_and_a_forged_or_replayed_one_alone_is_refused(
    url: str,
) -> None:
    keys = RunKeys("fold-ingest")
    coord = _coord(url, keys)
    agents = {h: Agent(url, keys, h) for h in HOSTS}
    for a in agents.values():
        a.steps(0, 20)
    got = _drain(coord, 20 * len(RANKS))
    assert _steps_by_rank(got, keys) == {r: list(range(20)) for r in RANKS}
    # Synthetic ids: unique and increasing per rank, as a direct stream's.
    for r in RANKS:
        ids = [tuple(map(int, d.entry_id.split("-"))) for d in got if d.stream == keys.up(r)]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)

    a = agents["h1"]
    forged = a.item(4, 20, key=fixed_keys(bytes(32)))  # a key that is not rank 4's
    replayed = a.items[3]  # rank 3's step 1, signed by rank 3, seq already taken
    a.seqs[4] -= 1  # the forged item took no seq of rank 4's
    good = [a.item(3, 20), a.item(4, 20), a.item(5, 20)]
    bad_entry = a.write([forged, replayed, *good])
    agents["h0"].steps(20, 1)
    got = _drain(coord, 6)
    assert _steps_by_rank(got, keys) == {r: [20] for r in RANKS}
    admin = connect(url)
    dead = admin.xrange(keys.dlq)
    assert [(f[b"stream"], f[b"entry"]) for _, f in dead] == [
        (a.stream.encode(), bad_entry.encode()),
        (a.stream.encode(), bad_entry.encode()),
    ]
    reasons = [f[b"reason"].decode() for _, f in dead]
    assert reasons[0].startswith(f"folded item 0 ({keys.up(4)}): authentication failed"), reasons
    assert reasons[1].startswith(f"folded item 1 ({keys.up(3)}): {entries.REPLAYED}"), reasons
    admin.close()
    coord.flush_acks()
    assert _fold_pending(url, keys) == 0  # every fold entry acked, the refused ones too
    assert coord.read_upstream(200) == []
    coord.close()


def test_a_reader_killed_mid_fold_loses_and_repeats_nothing_and_still_refuses_replays(
    url: str,
) -> None:
    keys = RunKeys("fold-kill")
    coord = _coord(url, keys)
    pool = coord.ingest
    assert pool is not None
    agents = {h: Agent(url, keys, h) for h in HOSTS}
    n = 1500
    for a in agents.values():
        a.steps(0, n)
    mine = fold.host_stream(keys.prefix, "h0")  # the first fold stream: reader 0's
    theirs = {keys.up(r) for r in HOSTS["h0"]}
    got: list[Delivery] = []
    deadline = time.monotonic() + 60
    while sum(d.stream in theirs for d in got) < 300 and time.monotonic() < deadline:
        ds = coord.read_upstream(100)
        coord.ack(ds)
        got += ds
    with structlog.testing.capture_logs() as logs:
        # Killed with entries received and not acked: its successor starts after them.
        ds = coord.read_upstream(100)
        got += ds
        victim = pool.pids[0]
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while pool.restarts < 1 and time.monotonic() < deadline:
            more = coord.read_upstream(100)
            got += more
            ds += more
        assert pool.restarts == 1
        coord.ack(ds)
        got += _drain(coord, n * len(RANKS) - len(got))
    assert [e["reader"] for e in logs if e["event"] == "bus_ingest_reader_died"] == [
        "coordinator.ingest.0"
    ]
    assert _steps_by_rank(got, keys) == {r: list(range(n)) for r in RANKS}
    # Killed again with nothing pending (every entry acked): its successor re-reads
    # nothing, so only the seqs it is started with tell it an old item is a replay.
    coord.flush_acks()
    assert _fold_pending(url, keys) == 0
    victim = pool.pids[0]
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while pool.restarts < 2 and time.monotonic() < deadline:
        assert coord.read_upstream(100) == []
    assert pool.restarts == 2 and pool.wait_ready(60)
    a = agents["h0"]
    a.write([a.items[0]])
    a.steps(n, 1)
    got = _drain(coord, len(HOSTS["h0"]))
    assert _steps_by_rank(got, keys) == {r: [n] for r in HOSTS["h0"]}
    admin = connect(url)
    (reason,) = [f[b"reason"].decode() for _, f in admin.xrange(keys.dlq)]
    assert entries.REPLAYED in reason and mine.encode() in admin.xrange(keys.dlq)[0][1][b"stream"]
    admin.close()
    assert coord.read_upstream(200) == []
    coord.flush_acks()
    assert _fold_pending(url, keys) == 0
    coord.close()


def test_a_reader_that_keeps_dying_hands_its_folds_and_their_seqs_to_the_coordinators_thread(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ingest, "MAX_RESTARTS", 0)
    keys = RunKeys("fold-dies")
    coord = _coord(url, keys)
    pool = coord.ingest
    assert pool is not None
    agents = {h: Agent(url, keys, h) for h in HOSTS}
    n = 800
    for a in agents.values():
        a.steps(0, n)
    got = _drain(coord, n * len(RANKS))
    # Everything acked: the coordinator's thread re-reads nothing, so only the seqs
    # handed over tell it an old item is a replay.
    coord.flush_acks()
    assert _fold_pending(url, keys) == 0
    read, logs = kill_until_in_thread(coord, 1)
    got += read
    assert [e["event"] for e in logs if e["event"] == "bus_ingest_in_thread"]
    # In-thread now: new steps and a replay of an item the readers delivered.
    a = agents["h1"]
    a.write([a.items[1]])
    a.steps(n, 1)
    got += _drain(coord, len(HOSTS["h1"]))
    assert _steps_by_rank(got, keys) == {
        r: list(range(n + 1 if r in HOSTS["h1"] else n)) for r in RANKS
    }
    admin = connect(url)
    (dead,) = admin.xrange(keys.dlq)
    assert entries.REPLAYED in dead[1][b"reason"].decode()
    admin.close()
    assert coord.read_upstream(200) == []
    coord.flush_acks()
    assert _fold_pending(url, keys) == 0
    coord.close()
