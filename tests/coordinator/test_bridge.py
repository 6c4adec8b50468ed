"""A bridge's size is the longest wait among the ranks the gate waits for, however it is
found (``coordinator.bridge``), and the speeds it reads follow ElChe's rings."""

from __future__ import annotations

import math
import random

import pytest

from flodl_bus.coordinator import bridge
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.elche import ElChe, WindowReport
from flodl_bus.coordinator.ledger import Ledger
from flodl_bus.coordinator.numeric import ordered_sum
from flodl_bus.protocol import messages as m
from tests.coordinator.drive import feed, make


class _Idle:
    """A dispatch view in which the ranks of ``idle`` can be given nothing more."""

    def __init__(self, idle: set[int]) -> None:
        self.idle = idle

    def quiesced(self, r: int) -> bool:
        return r in self.idle


def _by_definition(core: Coordinator, view: bridge.Quiesced, r: int, next_window: bool) -> int:
    """The bridge's size as its docstring defines it: a full scan of ``owing``."""
    counts, steps = core.elche.counts, core.ledger.steps
    waits = [
        (counts[s] - steps[s]) * ms
        for s in bridge.owing(core, view, r)
        if (ms := bridge.ms_per_batch(core, s)) is not None
    ]
    owed_ms = max(waits, default=0.0)
    mine = bridge.ms_per_batch(core, r)
    if mine is None or owed_ms <= 0.0:
        wait = 1
    else:
        wait = max(1, min(math.ceil(owed_ms / mine), counts[r]))
    return wait + counts[r] if next_window else wait


@pytest.mark.parametrize("aside_max", [bridge.ASIDE_MAX, 1])
def test_a_bridge_is_sized_by_the_longest_owed_wait_as_a_full_scan_would_size_it(
    aside_max: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # aside_max 1: the heap gives way to a walk as soon as two ranks are set aside
    monkeypatch.setattr(bridge, "ASIDE_MAX", aside_max)
    rng = random.Random(11)
    ws = 12
    core = make("cpu-cadence", ws=ws, total=100_000, heartbeat_timeout=1.0)
    # some ranks calibrated at various speeds, three never measured (no ring: their speed
    # is their window's, wall time over steps)
    unmeasured = (2, 7, 9)
    readings = tuple(None if r in unmeasured else rng.uniform(5.0, 60.0) for r in range(ws))
    core.elche.report_window(WindowReport(readings))
    core.start(0.0)
    silent = 5  # never heard again: declared dead once the timeout passes
    index = bridge.OwedWaits()  # kept across the run, as the dispatch keeps its own
    for turn in range(300):
        now = turn * 0.01
        r = rng.choice([s for s in range(ws) if s != silent])
        feed(core, r, rng.randint(1, 3), now=now, ms=rng.uniform(5.0, 80.0))
        core.tick(now)
        if turn % 7 == 0:
            # a speed reading moves the rings (and the cached speeds with them)
            speeds = (None if s in unmeasured else rng.uniform(5.0, 60.0) for s in range(ws))
            core.elche.report_window(WindowReport(tuple(speeds)))
        # the pool's own view, and views in which some ranks owing steps have no work
        views = [core.dispatch, _Idle({s for s in range(ws) if rng.random() < 0.3})]
        for view in views:
            for s in range(ws):
                for next_window in (False, True):
                    want = _by_definition(core, view, s, next_window)
                    got = bridge.batches(core, view, s, next_window=next_window)
                    assert got == want, (turn, s)
                    fast = bridge.batches(core, view, s, next_window=next_window, index=index)
                    assert fast == want, (turn, s, "indexed")
    assert not core.alive(silent)
    assert core.ledger.steps[silent] < core.elche.counts[silent]


def test_the_speeds_a_bridge_reads_follow_every_change_of_the_rings() -> None:
    e = ElChe(world_size=3)
    assert e.smoothed_all() == [None, None, None]

    def fresh() -> list[float | None]:
        return [ordered_sum(ring) / len(ring) if ring else None for ring in e._rings]

    e.report_window(WindowReport((10.0, 20.0, None)))
    assert e.smoothed_all() == fresh() == [10.0, 20.0, None]
    e.report_window(WindowReport((30.0, 20.0, 5.0)))
    assert e.smoothed_all() == fresh() == [20.0, 20.0, 5.0]
    assert e.smoothed_ms(0) == 20.0
    e.forget(0)
    assert e.smoothed_ms(0) is None
    assert e.smoothed_all() == fresh()
    state = e.state()
    other = ElChe(world_size=3)
    other.report_window(WindowReport((99.0, 99.0, 99.0)))
    assert other.smoothed_all() == [99.0, 99.0, 99.0]
    other.restore(state)
    assert other.smoothed_all() == fresh()


def test_a_step_report_alone_leaves_the_speeds_a_bridge_reads_unchanged() -> None:
    core = make("cpu-cadence", ws=2, total=1000)
    core.elche.report_window(WindowReport((10.0, 40.0)))
    core.start(0.0)
    before = list(core.elche.smoothed_all())
    core.handle(0, m.Batch(0, 99.0, 0.0, 1, 0.5), 0.0)
    assert core.elche.smoothed_all() == before == [10.0, 40.0]


class _View:
    """The core as a bridge reads it, each part replaceable as the real ones are (a new
    counts list at a recalibration, new speeds when the rings move, a new ledger a
    window, a new live index at a death or an exit)."""

    def __init__(self, counts: list[int], speeds: list[float | None], alive: list[int]) -> None:
        self.elche = self
        self.counts = counts
        self.speeds = speeds
        self.ledger = Ledger(len(counts))
        self.alive = alive

    def smoothed_all(self) -> list[float | None]:
        return self.speeds

    def alive_ranks(self) -> list[int]:
        return self.alive


def test_the_owed_waits_follow_each_part_they_are_built_from_whatever_else_stays() -> None:
    view = _View([10, 10, 10, 10], [1.0, 2.0, 3.0, None], [0, 1, 2, 3])
    index = bridge.OwedWaits()
    busy = _Idle(set())

    def both() -> tuple[float, float]:
        return index.longest(view, busy, 0), bridge._walk(view, busy, 0)  # type: ignore[arg-type]

    assert both() == (30.0, 30.0)  # rank 2: 10 batches at 3 ms
    view.ledger.record_batch(2, 3.0, 0.0, 0.5)
    view.ledger.record_batch(3, 9.0, 0.0, 0.5)  # uncalibrated: its window's 9 ms a batch
    assert both() == (81.0, 81.0)
    view.speeds = [1.0, 5.0, 3.0, None]  # the rings moved; the counts did not
    assert both() == (81.0, 81.0)
    view.ledger.record_batch(3, 0.0, 0.0, 0.5)  # 4.5 ms a batch now: 36 ms owed
    assert both() == (50.0, 50.0)
    view.alive = [0, 2, 3]  # rank 1 left; nothing else changed
    assert both() == (36.0, 36.0)
    view.ledger = Ledger(4)  # a new window
    assert both() == (30.0, 30.0)
