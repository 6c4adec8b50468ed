"""Trimming streams to what their readers consumed (``bus.trim``, DESIGN §3 rule 5).

Passes are driven by hand (``trim_now`` with a chosen clock) so each test decides when a
pass runs and how much time it says has passed; the streams are real.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import structlog

from flodl_bus.bus.api import Delivery
from flodl_bus.bus.ids import ZERO
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.stream_ops import StreamsConfig
from flodl_bus.bus.streams import RedisCoordinatorBus, RedisRankBus
from flodl_bus.bus.trim import GroupHold, Trimmer
from flodl_bus.protocol import messages as m
from tests.bus.conftest import CK, FAST, RK, Backend

#: no trimmer thread: every pass is a ``trim_now`` of the test
MANUAL = StreamsConfig(backoff=FAST.backoff, trim_interval_s=0, trim_stale_s=60.0)


def _steps(ds: Sequence[Delivery]) -> list[int]:
    return [d.msg.global_step for d in ds if isinstance(d.msg, m.SetGlobalStep)]


def _drain(bus: RedisRankBus, ack: bool = True) -> list[Delivery]:
    got: list[Delivery] = []
    while True:
        ds = bus.read_control(20)
        # an empty read with nothing held back: all read
        if not ds and bus._reader.cursor.can_block:
            return got
        if ack:
            bus.ack(ds)
        got += ds


def _report(bus: RedisRankBus, coord: RedisCoordinatorBus) -> None:
    """What a rank's heartbeat does: tell the coordinator how far it read its control
    (a rank has no group the trimmer could look at)."""
    ctl, bcast = bus.control_read()
    beat = m.Heartbeat(rank=bus.rank, step_count=0, ctl_read=ctl, all_read=bcast)
    bus.publish(beat)
    assert bus.flush(20)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the event: the coordinator read that heartbeat
        ds = coord.read_upstream(20)
        coord.ack(ds)
        if any(d.msg == beat for d in ds):
            return
    raise AssertionError("the coordinator never read the heartbeat")


def _drain_up(coord: RedisCoordinatorBus) -> list[Delivery]:
    got: list[Delivery] = []
    while True:
        ds = coord.read_upstream(20)
        if not ds:
            return got
        coord.ack(ds)
        got += ds


def _batch(rank: int, i: int) -> m.Batch:
    return m.Batch(rank=rank, batch_ms=1.0, data_ms=0.1, step_count=i, batch_loss=0.5)


def _events(logs: list[dict[str, object]], name: str) -> list[dict[str, object]]:
    return [e for e in logs if e.get("event") == name]


# ------------------------------------------------------------------ the rule, sans-IO


def test_the_first_pass_only_learns_each_streams_top() -> None:
    t = Trimmer()
    assert t.plan(0.0, {"s": (100, 0)}, {"s": [GroupHold("g", (100, 0))]}) == {}
    assert t.plan(1.0, {"s": (200, 0)}, {"s": [GroupHold("g", (200, 0))]}) == {"s": (100, 0)}


def test_a_group_behind_the_margin_holds_the_stream_until_it_is_stale() -> None:
    t = Trimmer(stale_s=10.0)
    t.plan(0.0, {"s": (100, 0)}, {})
    assert t.plan(1.0, {"s": (200, 0)}, {"s": [GroupHold("g", (50, 0))]}) == {"s": (50, 0)}
    # moving resets its clock
    assert t.plan(9.0, {"s": (300, 0)}, {"s": [GroupHold("g", (60, 0))]}) == {"s": (60, 0)}
    assert t.plan(18.9, {"s": (400, 0)}, {"s": [GroupHold("g", (60, 0))]}) == {"s": (60, 0)}
    with structlog.testing.capture_logs() as logs:
        assert t.plan(19.0, {"s": (500, 0)}, {"s": [GroupHold("g", (60, 0))]}) == {"s": (400, 0)}
        t.plan(30.0, {"s": (600, 0)}, {"s": [GroupHold("g", (60, 0))]})
    assert len(_events(logs, "bus_reader_stale")) == 1  # once, not every pass


def test_a_group_that_was_up_to_date_is_not_stale_the_moment_new_entries_come() -> None:
    t = Trimmer(stale_s=10.0)
    t.plan(0.0, {"s": (100, 0)}, {"s": [GroupHold("g", (100, 0))]})
    for now in (5.0, 50.0, 100.0):  # idle, up to date, for a long time
        t.plan(now, {"s": (100, 0)}, {"s": [GroupHold("g", (100, 0))]})
    # new entries arrive; the group has not read them yet: it holds
    assert t.plan(101.0, {"s": (200, 0)}, {"s": [GroupHold("g", (100, 0))]}) == {"s": (100, 0)}
    assert t.plan(102.0, {"s": (300, 0)}, {"s": [GroupHold("g", (100, 0))]}) == {"s": (100, 0)}


def test_the_margin_never_passes_the_newest_verified_entry() -> None:
    t = Trimmer()
    t.plan(0.0, {"s": (100, 0)}, {})
    # a group far ahead (it was handed a foreign entry) does not lift the floor
    assert t.plan(1.0, {"s": (100, 0)}, {"s": [GroupHold("g", (10**15, 0))]}) == {"s": (100, 0)}
    t.plan(2.0, {"z": ZERO}, {})
    assert "z" not in t.plan(3.0, {"z": ZERO}, {})


# ------------------------------------------------------------------ real streams


def test_a_long_run_keeps_every_stream_to_about_one_pass_of_entries(backend: Backend) -> None:
    keys = RunKeys("trimlong")
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=[0, 1], config=MANUAL)
    ranks = [RedisRankBus(backend.make(), keys, r, RK(r), config=MANUAL) for r in (0, 1)]
    per_pass = 240  # upstream entries per rank per pass; control 60 + 12 broadcast
    control: dict[int, list[int]] = {0: [], 1: []}
    upstream: dict[int, list[int]] = {0: [], 1: []}
    longest: dict[str, int] = {}
    step = 0
    passes = 30
    for p in range(passes):
        for i in range(72):
            msg = m.SetGlobalStep(global_step=step)
            step += 1
            coord.broadcast(msg) if i % 6 == 0 else coord.send(i % 2, msg)
        for r, bus in enumerate(ranks):
            for i in range(per_pass):
                bus.publish(_batch(r, p * per_pass + i))
            control[r] += _steps(_drain(bus))
            ctl, bcast = bus.control_read()
            bus.publish(m.Heartbeat(rank=r, step_count=p, ctl_read=ctl, all_read=bcast))
            assert bus.flush(20)
        for d in _drain_up(coord):
            if isinstance(d.msg, m.Batch):
                upstream[d.msg.rank].append(d.msg.step_count)
        for bus in ranks:
            bus.flush_acks()
        coord.flush_acks()
        coord.trim_now(float(p))
        if p >= 3:
            for s in (keys.ctl(0), keys.ctl(1), keys.ctl_all, keys.up(0), keys.up(1)):
                longest[s] = max(longest.get(s, 0), backend.admin.xlen(s))
    # nothing lost, nothing twice, in order
    for r in (0, 1):
        assert upstream[r] == list(range(passes * per_pass))
        want = [s for s in range(step) if s % 72 % 6 == 0 or s % 72 % 2 == r]
        assert control[r] == want
    # each stream holds about two passes of entries (the margin and the pass just
    # written), plus one radix-tree node that ``~`` keeps, never the whole run
    for s, most in longest.items():
        written = passes * (per_pass + 1 if ":up:" in s else 36)
        assert most <= 2 * written / passes + 100, (s, most, written)
        assert most < written / 4, (s, most, written)
    if backend.real:
        used = sum(
            backend.admin.memory_usage(s) or 0  # type: ignore[misc]
            for s in (keys.ctl(0), keys.ctl(1), keys.ctl_all, keys.up(0), keys.up(1))
        )
        print(f"bytes per rank after {passes * per_pass} upstream entries each: {used // 2}")
        assert used // 2 < 200_000
    for bus in ranks:
        bus.close()
    coord.close()


def test_a_slow_reader_holds_trimming_back_and_reads_every_entry_later(
    backend: Backend,
) -> None:
    keys = RunKeys("trimslow")
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=[0, 1], config=MANUAL)
    fast = RedisRankBus(backend.make(), keys, 0, RK(0), config=MANUAL)
    step = 0
    for p in range(20):  # 20 passes, far less than trim_stale_s of clock
        for i in range(50):
            msg = m.SetGlobalStep(global_step=step)
            step += 1
            coord.broadcast(msg) if i % 2 else coord.send(1, msg)
        _drain(fast)
        _report(fast, coord)
        coord.trim_now(float(p))
    # rank 1 never read: every entry it was sent is still there
    assert backend.admin.xlen(keys.ctl(1)) == 500
    assert backend.admin.xlen(keys.ctl_all) == 500
    with structlog.testing.capture_logs() as logs:
        slow = RedisRankBus(backend.make(), keys, 1, RK(1), config=MANUAL)
        assert _steps(_drain(slow)) == list(range(step))
    assert not _events(logs, "bus_entries_missing")
    assert not _events(logs, "bus_dead_letter")
    # once it has read them (and said so), they go
    _report(slow, coord)
    coord.trim_now(30.0)
    coord.trim_now(31.0)
    assert backend.admin.xlen(keys.ctl_all) < 200
    slow.close()
    fast.close()
    coord.close()


def test_entries_a_rank_has_not_said_it_read_survive_trimming(backend: Backend) -> None:
    keys = RunKeys("trimpending")
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=[0], config=MANUAL)
    rank = RedisRankBus(backend.make(), keys, 0, RK(0), config=MANUAL)
    for i in range(300):
        coord.send(0, m.SetGlobalStep(global_step=i))
    got = _drain(rank, ack=False)
    assert len(got) == 300
    rank.ack(got[:100])  # taken over: the first 100 only
    _report(rank, coord)
    for p in range(10):
        coord.send(0, m.SetGlobalStep(global_step=300 + p))
        coord.trim_now(float(p))
    # every entry above what the rank reported is still there for it
    kept = backend.admin.xrange(keys.ctl(0), min=f"({got[99].entry_id}", max="+")
    assert len(kept) == 210
    rank.close()
    coord.close()


def test_writers_restarted_after_trimming_continue_their_seq(backend: Backend) -> None:
    keys = RunKeys("trimrestart")
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=[0], config=MANUAL)
    rank = RedisRankBus(backend.make(), keys, 0, RK(0), config=MANUAL)
    for p in range(6):
        for i in range(100):
            rank.publish(_batch(0, p * 100 + i))
            coord.send(0, m.SetGlobalStep(global_step=p * 100 + i))
        assert rank.flush(20)
        _drain(rank)
        _report(rank, coord)
        coord.flush_acks()
        coord.trim_now(float(p))
    assert backend.admin.xlen(keys.up(0)) < 300  # trimmed, not empty
    assert backend.admin.xlen(keys.ctl(0)) >= 1
    with structlog.testing.capture_logs() as logs:
        rank.close()
        rank = RedisRankBus(backend.make(), keys, 0, RK(0), config=MANUAL)
        rank.publish(_batch(0, 600))
        assert rank.flush(20)
        up = _drain_up(coord)
        coord.close()
        coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=[0], config=MANUAL)
        coord.send(0, m.SetGlobalStep(global_step=600))
        ctl = _drain(rank)
    assert [d.msg.step_count for d in up] == [600]  # type: ignore[attr-defined]
    # a reader with the same keys reads what is left from the start (a real rank's
    # keys are new at each start); the coordinator's seq goes on above the old ones
    steps = _steps(ctl)
    assert steps[-1] == 600 and steps == sorted(set(steps))
    assert not _events(logs, "bus_dead_letter")
    rank.close()
    coord.close()


def test_a_reader_gone_past_the_stale_time_is_trimmed_past_and_the_loss_is_named(
    backend: Backend,
) -> None:
    keys = RunKeys("trimgone")
    config = StreamsConfig(backoff=FAST.backoff, trim_interval_s=0, trim_stale_s=10.0)
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=[0], config=config)
    gone = RedisRankBus(backend.make(), keys, 0, RK(0), config=config)
    coord.send(0, m.SetGlobalStep(global_step=0))
    assert _steps(_drain(gone)) == [0]
    _report(gone, coord)
    with structlog.testing.capture_logs() as logs:
        for p in range(8):  # 8 passes, 5 s apart: it stops holding after 10 s
            for i in range(40):
                coord.send(0, m.SetGlobalStep(global_step=1 + p * 40 + i))
            coord.trim_now(p * 5.0)
        assert backend.admin.xlen(keys.ctl(0)) < 320
        late = _steps(_drain(gone))
    assert late and late[-1] == 320 and late[0] > 1
    stale = _events(logs, "bus_reader_stale")
    assert [e["stream"] for e in stale] == [keys.ctl(0)]
    missing = _events(logs, "bus_entries_missing")
    assert len(missing) == 1 and missing[0]["seqs"] == f"2..{late[0]}"
    gone.close()
    coord.close()


def test_the_trimmer_thread_trims_on_its_own(backend: Backend) -> None:
    keys = RunKeys("trimthread")
    config = StreamsConfig(backoff=FAST.backoff, trim_interval_s=0.05)
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=[0], config=config)
    rank = RedisRankBus(backend.make(), keys, 0, RK(0), config=config)
    for i in range(2000):
        coord.send(0, m.SetGlobalStep(global_step=i))
    assert len(_drain(rank)) == 2000
    _report(rank, coord)
    start = coord.trimmed_passes
    while coord.trimmed_passes < start + 3:  # the event waited on: passes done
        rank.read_control(20)
    assert backend.admin.xlen(keys.ctl(0)) < 300
    rank.close()
    coord.close()
