"""Bridges (issue 19 item 5, issue 27): work for a cadence rank the reduce would hold idle.

A rank whose window is full, or whose final-window slot is spent, has nothing to train
until every rank has met its count and the SyncNow comes. A bridge is a chunk of its own
epoch that keeps it training meanwhile: it takes the SyncNow between two batches, so it
waits at most the batch it is on per averaging instead of the slow rank's rest. It is
sized by wall time (flodl sizes windows by speed; this sizes the wait the same way): the
batches the rank trains while the slowest rank still owing steps finishes its window at
its measured speed, at least one and at most the rank's own window. What it trains after
the SyncNow counts in the next window; the collective weighs every batch by the work
each rank really did.

On the CPU plane (``cpu_bridges``) the bridging rank takes the round's RequestParams
between two batches: what it trained before its snapshot is in the snapshot, weighed by
its true steps; what it trains after stays on top of the consensus at the Update
(``--overlap-rounds``), and its Batches that reach the coordinator after the trigger
count in the next window, as the NCCL bridge's after its SyncNow. With no epoch barrier
there, a bridge may come from the next epoch, as any chunk of the rank may. A cpu bridge
also carries the rank's next window (its count more batches): the round takes no rank out
of its chunk, so the rank goes on into that window in the same plan instead of reporting
the bridge, waiting a trip through the coordinator for its next chunk and reporting that
one too (two turn-overs a window, each a trip through Redis and back, where the bridge
meant to save one wait).

Sans-IO like the core; ``PoolDispatch`` asks and takes the chunk.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator
from typing import Final, Protocol

from flodl_bus.coordinator.config import Backend, CoordinatorConfig, Policy
from flodl_bus.coordinator.elche import ElChe
from flodl_bus.coordinator.ledger import Ledger


class WindowWaits(Protocol):
    """What a bridge asks of the reduce."""

    def window_waits(self, window: Ledger) -> bool: ...


class Quiesced(Protocol):
    """What a bridge asks of the dispatch."""

    def quiesced(self, r: int) -> bool: ...


class BridgeCore(Protocol):
    """The core as a bridge sees it: read only (the part imports no core back)."""

    @property
    def ws(self) -> int: ...
    @property
    def elche(self) -> ElChe: ...
    @property
    def ledger(self) -> Ledger: ...
    @property
    def reduce(self) -> WindowWaits: ...
    def alive(self, r: int) -> bool: ...
    def alive_ranks(self) -> list[int]: ...
    def gate(self) -> tuple[bool, str]: ...


def applies(cfg: CoordinatorConfig) -> bool:
    """Cadence with a reduce to wait for (a world of one has none). On the CPU plane only
    with ``cpu_bridges`` (the ranks keep their round steps): otherwise a rank's work after
    its snapshot would be overwritten by the Update."""
    if cfg.policy is not Policy.CADENCE or cfg.world_size < 2:
        return False
    if cfg.backend is Backend.NCCL:
        return cfg.bridge_idle
    return cfg.cpu_bridges


def wanted(core: BridgeCore, r: int) -> bool:
    """Whether idle rank ``r`` would wait on the reduce (not on its own window)."""
    if core.gate()[0] and not core.reduce.window_waits(core.ledger):
        return False  # the reduce fires on this tick; its wake-up hands r its window
    # A window without a marginal sample yet (one batch): a bridge out would hold the
    # window wait (§4.6.1) on this rank instead of shortening anything.
    return core.ledger.delivered_batches[r] > 0


def owing(core: BridgeCore, dispatch: Quiesced, r: int) -> Iterator[int]:
    """The live ranks other than ``r`` short of their count that can still step: the
    ranks the gate waits for, lazily (a caller asking whether any owes stops at the
    first: a list of them per chunk drawn was most of ``handle`` at 1,024 ranks)."""
    counts, steps = core.elche.counts, core.ledger.steps
    return (
        s
        for s in range(core.ws)
        if s != r and steps[s] < counts[s] and core.alive(s) and not dispatch.quiesced(s)
    )


def owes_any(core: BridgeCore, dispatch: Quiesced, r: int) -> bool:
    """Whether any rank but ``r`` still owes the gate steps (``owing``)."""
    return next(owing(core, dispatch, r), None) is not None


#: ranks ``OwedWaits`` sets aside for one query (the asking rank, ranks with no more
#: work) before it walks every rank instead
ASIDE_MAX: Final = 64


class OwedWaits:
    """The longest owed wait (``batches``) without a walk over every rank per bridge: at
    4,096 simulated ranks that walk was two thirds of the core's time (``bench
    coordinator``, nccl-cadence: 19,450 bridges of 466 µs each).

    Within one window, with the same counts, speeds and live ranks, a calibrated rank's
    wait ``(count - steps) x speed`` only falls, as its steps only grow. So its waits
    sit in a max-heap under the steps they were computed at: an entry whose steps have
    moved is an upper bound, brought up to date only when it reaches the top. A change of
    counts, speeds, ledger (a new window) or the live ranks rebuilds the heap, O(N). The
    uncalibrated ranks (their speed is this window's, wall time over steps, which does
    not only fall) are walked as before. The rank asking and ranks that can give no more
    work (``Quiesced``) are set aside for the query and put back."""

    __slots__ = ("_heap", "_key", "_uncalibrated")

    def __init__(self) -> None:
        #: the lists and ledger the heap was built from, held so their ids stay theirs
        self._key: tuple[object, ...] | None = None
        self._heap: list[tuple[float, int, int]] = []
        self._uncalibrated: list[int] = []

    def longest(self, core: BridgeCore, dispatch: Quiesced, r: int) -> float:
        """What ``batches`` walks for: the longest wait of a rank in ``owing`` but
        ``r``, in ms (0.0: none)."""
        counts, smoothed = core.elche.counts, core.elche.smoothed_all()
        ledger, alive = core.ledger, core.alive_ranks()
        key = self._key
        if (
            key is None
            or key[0] is not counts
            or key[1] is not smoothed
            or key[2] is not ledger
            or key[3] is not alive
        ):
            self._build(counts, smoothed, ledger, alive)
        steps, wall_ms = ledger.steps, ledger.wall_ms
        owed_ms = 0.0
        for s in self._uncalibrated:
            step = steps[s]
            left = counts[s] - step
            if left <= 0 or s == r or step <= 0:
                continue
            ms = wall_ms[s] / step
            if ms > 0.0 and left * ms > owed_ms and not dispatch.quiesced(s):
                owed_ms = left * ms
        heap = self._heap
        aside: list[tuple[float, int, int]] = []
        while heap:
            neg, s, at = heap[0]
            step = steps[s]
            if step != at:
                left = counts[s] - step
                if left <= 0:
                    heapq.heappop(heap)  # done with its window: never owes again in it
                else:
                    heapq.heapreplace(heap, (-(left * smoothed[s]), s, step))  # type: ignore[operator]
                continue
            if -neg <= owed_ms:
                break
            if s == r or dispatch.quiesced(s):
                if len(aside) >= ASIDE_MAX:
                    # Many ranks with no more work (an epoch's tail): a walk is cheaper
                    # than taking them all out of the heap and back at every bridge.
                    owed_ms = max(owed_ms, _walk(core, dispatch, r))
                    break
                aside.append(heapq.heappop(heap))
                continue
            owed_ms = -neg
            break
        for entry in aside:
            heapq.heappush(heap, entry)
        return owed_ms

    def _build(
        self,
        counts: list[int],
        smoothed: list[float | None],
        ledger: Ledger,
        alive: list[int],
    ) -> None:
        self._key = (counts, smoothed, ledger, alive)
        steps = ledger.steps
        heap: list[tuple[float, int, int]] = []
        uncalibrated: list[int] = []
        for s in alive:
            ms = smoothed[s]
            if ms is None:
                uncalibrated.append(s)
                continue
            left = counts[s] - steps[s]
            if ms > 0.0 and left > 0:
                heap.append((-(left * ms), s, steps[s]))
        heapq.heapify(heap)
        self._heap, self._uncalibrated = heap, uncalibrated


def batches(
    core: BridgeCore,
    dispatch: Quiesced,
    r: int,
    *,
    next_window: bool = False,
    index: OwedWaits | None = None,
) -> int:
    """The bridge's size in batches (before the pool's remainder caps it); with
    ``next_window`` (the CPU plane) the rank's next window rides on it. ``index``: the
    dispatch's ``OwedWaits``, kept between calls (without one, every rank is walked)."""
    counts = core.elche.counts
    owed_ms = _walk(core, dispatch, r) if index is None else index.longest(core, dispatch, r)
    mine = ms_per_batch(core, r)
    if mine is None or owed_ms <= 0.0:
        wait = 1
    else:
        wait = max(1, min(math.ceil(owed_ms / mine), counts[r]))
    return wait + counts[r] if next_window else wait


def _walk(core: BridgeCore, dispatch: Quiesced, r: int) -> float:
    """``OwedWaits.longest`` by a walk over every live rank."""
    counts, steps, smoothed = core.elche.counts, core.ledger.steps, core.elche.smoothed_all()
    wall_ms = core.ledger.wall_ms
    owed_ms = 0.0
    # The longest wait of any rank in ``owing``. Whether a rank can still step is asked
    # only of one whose wait would be the longest so far: asked of every rank for every
    # chunk sized, it made ``handle`` O(N) a chunk and a window O(N^2) (88 µs a message
    # at 1,024 simulated ranks). The dead are not walked at all: their counts are kept
    # and their speeds forgotten, so each cost a re-derived speed per bridge (after a
    # mass death at 1,024 simulated ranks, ``handle`` went from 6 to 32 µs a message).
    alive = core.alive_ranks()
    if len(alive) == len(counts):
        rows: Iterable[tuple[int, int, int, float | None]] = zip(
            range(len(counts)), counts, steps, smoothed
        )
    else:
        rows = zip(
            alive,
            map(counts.__getitem__, alive),
            map(steps.__getitem__, alive),
            map(smoothed.__getitem__, alive),
        )
    for s, count, step, ms in rows:
        left = count - step
        if left <= 0 or s == r:
            continue
        if ms is None:
            # ``ms_per_batch`` inline (this window's speed, before the first calibration):
            # every uncalibrated rank takes this path at every bridge of a run's start.
            if step <= 0:
                continue
            ms = wall_ms[s] / step
        if ms <= 0.0:
            continue  # as ``ms_per_batch`` has it: no speed
        if left * ms > owed_ms and not dispatch.quiesced(s):
            owed_ms = left * ms
    return owed_ms


def ms_per_batch(core: BridgeCore, r: int) -> float | None:
    """ElChe's smoothed speed, or this window's before the first calibration."""
    ms = core.elche.smoothed_ms(r)
    ledger = core.ledger
    if ms is None and ledger.steps[r] > 0:
        ms = ledger.wall_ms[r] / ledger.steps[r]
    return ms if ms is not None and ms > 0.0 else None
