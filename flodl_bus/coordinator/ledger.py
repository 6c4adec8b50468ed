"""What each rank did since the last reduce: the window the coordinator is filling.

A leaf: the core, the reduce and the dispatch parts all read it, so it imports none of
them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import compress, count, repeat
from operator import lt

from flodl_bus.coordinator.tracked import Tracked

__all__ = ["Ledger"]


class Ledger:
    """What each rank did since the last reduce (reference §4.3)."""

    __slots__ = (
        "_short",
        "_short_for",
        "delivered_batches",
        "delivered_ms",
        "first_batch_ms",
        "loss_count",
        "loss_sum",
        "steps",
        "wall_ms",
    )

    def __init__(self, world_size: int) -> None:
        #: tracked: the state summary reads only the entries written since it last looked
        self.steps = Tracked([0] * world_size)
        self.wall_ms = [0.0] * world_size
        self.delivered_ms = [0.0] * world_size
        self.delivered_batches = [0] * world_size
        self.first_batch_ms: list[float | None] = [None] * world_size
        self.loss_sum = [0.0] * world_size
        self.loss_count = [0] * world_size
        #: ranks that were short of their count when last looked at, in rank order, and
        #: the counts list they were short of (``first_short``)
        self._short: list[int] | None = None
        self._short_for: list[int] | None = None

    def record_batch(self, r: int, batch_ms: float, data_ms: float, loss: float) -> None:
        self.steps[r] += 1
        self.wall_ms[r] += batch_ms
        # The first batch of a window carries the pipeline fill; only later batches are a
        # marginal (delivered) sample of the rank's speed.
        if self.first_batch_ms[r] is None:
            self.first_batch_ms[r] = batch_ms + data_ms
        else:
            self.delivered_ms[r] += batch_ms + data_ms
            self.delivered_batches[r] += 1
        if math.isfinite(loss):
            self.loss_sum[r] += loss
            self.loss_count[r] += 1

    def first_short(self, counts: list[int] | None, blocking: Callable[[int], bool]) -> int | None:
        """The lowest rank short of its count (``counts``; None: of one step) that
        ``blocking`` says holds the gate, or None.

        The gate asks this after every recorded message; a walk over every rank's steps
        was 15-30 µs of it at 1,024 ranks. Steps only grow in a ledger's life (a reduce
        starts a new one) and a counts list is replaced, never written in place, so a
        rank once at its count stays there: the ranks short at the first look are kept,
        and each later look walks only those still listed up to the first that blocks,
        dropping the ones that reached their count. A new counts list starts over."""
        steps = self.steps
        short = self._short
        if short is None or self._short_for is not counts:
            need = repeat(1) if counts is None else counts
            short = self._short = list(compress(count(), map(lt, steps, need)))
            self._short_for = counts
        kept = 0
        for j, r in enumerate(short):
            if steps[r] >= (1 if counts is None else counts[r]):
                continue  # at its count for good: dropped below
            short[kept] = r
            kept += 1
            if blocking(r):
                if kept <= j:
                    del short[kept : j + 1]
                return r
        del short[kept:]
        return None

    def exclude(self, r: int, ms: float) -> None:
        """Callback time is not slowness: take it out of the window's wall time."""
        self.wall_ms[r] = max(self.wall_ms[r] - ms, 0.0)
        self.delivered_ms[r] = max(self.delivered_ms[r] - ms, 0.0)
