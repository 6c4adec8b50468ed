"""What each rank did since the last reduce: the window the coordinator is filling.

A leaf: the core, the reduce and the dispatch parts all read it, so it imports none of
them.
"""

from __future__ import annotations

import math

from flodl_bus.coordinator.tracked import Tracked

__all__ = ["Ledger"]


class Ledger:
    """What each rank did since the last reduce (reference §4.3)."""

    __slots__ = (
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

    def exclude(self, r: int, ms: float) -> None:
        """Callback time is not slowness: take it out of the window's wall time."""
        self.wall_ms[r] = max(self.wall_ms[r] - ms, 0.0)
        self.delivered_ms[r] = max(self.delivered_ms[r] - ms, 0.0)
