"""Fixed-partition dispatch (reference §4.10): each epoch cut once into one share per
rank; a rank holds one plan at a time, the rest of its share queued, and a dead rank's
remainder split among the survivors. The other strategy and the interface are in
``dispatch``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

from flodl_bus.coordinator.chunk_pool import (
    Range,
    equal_sizes,
    ratio_to_sizes,
    split_ranges,
    throughput_sizes,
)
from flodl_bus.coordinator.config import Policy
from flodl_bus.coordinator.dispatch_api import Dispatch, DispatchCore
from flodl_bus.coordinator.effects import Out, Send
from flodl_bus.coordinator.ledger import Ledger
from flodl_bus.protocol.messages import (
    EpochPlan,
    ExtendPartition,
    MetricsMsg,
    StartEpoch,
)


class _Reduce(Protocol):
    """What a fixed partition asks of the reduce (lockstep holds plans while a round is
    open)."""

    @property
    def in_flight(self) -> bool: ...
    @property
    def throttled(self) -> Sequence[bool]: ...
    def window_waits(self, window: Ledger) -> bool: ...


class PartitionCore(DispatchCore, Protocol):
    """The core as a fixed partition sees it: a dispatch's view, and the open round."""

    @property
    def reduce(self) -> _Reduce: ...


class PartitionDispatch(Dispatch):
    """Fixed partition: each epoch cut once into per-rank shares, one plan in flight."""

    barrier_on_reduce = True
    core: PartitionCore

    def __init__(self, core: PartitionCore) -> None:
        super().__init__(core)
        ws = core.ws
        #: the epoch being trained (-1 before the first)
        self.epoch = -1
        #: ranges sent to each rank and not yet reported (a plan and its extensions)
        self.sent: list[list[Range]] = [[] for _ in range(ws)]
        #: the rest of each rank's share, sent one plan at a time
        self.queued: list[deque[Range]] = [deque() for _ in range(ws)]
        #: batches each rank reported since its current plan was sent
        self.batches_done = [0] * ws

    def start(self, now: float, out: list[Out]) -> None:
        self._open_epoch(self.core.start_epoch, out)

    def has_in_flight(self, r: int) -> bool:
        return bool(self.sent[r])

    def in_flight(self, r: int) -> int:
        return sum(s for _, s in self.sent[r])

    def in_flight_all(self) -> list[int]:
        return [sum(s for _, s in sent) if sent else 0 for sent in self.sent]

    def quiesced(self, r: int) -> bool:
        return not self.sent[r] and not self.queued[r]

    def spares_gate(self, r: int) -> bool:
        # flodl spares quiesced ranks under pools only: a rank done with its epoch share
        # holds the gate until the epoch ends, and the ranks still working finish their
        # tail without rounds. Each such round would average their few steps with a
        # model that took none, and hold them (a sync round throttles) for 5-6 ms: at an
        # epoch's end of cpu-sync digits, three or four rounds of 0-4 steps (issue 27).
        # Spared where the tail cannot go on without a round: lockstep withholds the
        # next batch until the window is averaged, and a throttled rank waits for the
        # Update that releases it.
        if not self.quiesced(r):
            return False
        core = self.core
        if core.config.lockstep or not core.config.partition_tail_holds_gate:
            return True
        throttled = core.reduce.throttled
        return any(throttled[s] for s in range(core.ws) if core.alive(s))

    def current_epoch(self) -> int:
        return max(self.epoch, 0)

    def rank_epochs(self) -> list[int]:
        return [self.epoch] * self.core.ws

    def on_batch(self, r: int, now: float, out: list[Out]) -> None:
        self.batches_done[r] += 1

    def on_metrics(self, r: int, msg: MetricsMsg, now: float, out: list[Out]) -> None:
        if msg.epoch != self.epoch or not self.sent[r]:
            return
        # Whatever of the plan (and its extensions) the rank did not train goes back in
        # front of its queue: an ExtendPartition that raced the plan's end is not lost.
        leftover = _untrained(self.sent[r], msg.samples_processed)
        self.sent[r] = []
        self.batches_done[r] = 0
        for rng in reversed(leftover):
            self.queued[r].appendleft(rng)
        if self.core.training:
            self._send_next(r, out)

    def rollback(self, r: int, plan: EpochPlan) -> None:
        if plan.epoch != self.epoch:
            return
        rng = (plan.partition_offset, plan.partition_size)
        if rng in self.sent[r]:
            self.sent[r].remove(rng)
            self.queued[r].appendleft(rng)

    def aggregate_ready(self, now: float, out: list[Out]) -> bool:
        core = self.core
        busy = any(self.sent[r] or self.queued[r] for r in range(core.ws) if core.alive(r))
        if self.epoch == core.last_aggregated + 1 and self.epoch >= 0 and not busy:
            core.publish_epoch(self.epoch, None, out)
            return True
        return False

    def advance(self, now: float, out: list[Out], aggregated: bool) -> None:
        core = self.core
        if core.last_aggregated + 1 > self.epoch:
            if core.config.lockstep and (core.reduce.in_flight or any(core.ledger.steps)):
                # The epoch's last window is averaged first: its steps and the next
                # epoch's never share a round, whoever's report came first.
                return
            self._open_epoch(core.last_aggregated + 1, out)
        elif core.training:
            # A plan whose send failed went back to its queue; resend it.
            for r in range(core.ws):
                if core.alive(r) and not self.sent[r] and self.queued[r]:
                    self._send_next(r, out)

    def after_reduce(self, now: float, out: list[Out]) -> None:
        core = self.core
        if core.config.lockstep and core.training:
            # A new window: every rank with work left gets its next batch now.
            for r in range(core.ws):
                if core.alive(r):
                    self._send_next(r, out)

    def take_back(self, r: int) -> list[Range]:
        remainder = _untrained(self.sent[r], self.batches_done[r] * self.core.bs)
        remainder += list(self.queued[r])
        self.sent[r] = []
        self.queued[r].clear()
        return remainder

    def reassign(self, r: int, remainder: list[Range], now: float, out: list[Out]) -> None:
        core = self.core
        survivors = [s for s in range(core.ws) if core.alive(s)]
        if not survivors or not remainder:
            return
        total = sum(size for _, size in remainder)
        units = equal_sizes(total // core.bs, len(survivors))
        shares = split_ranges(remainder, [u * core.bs for u in units])
        for s, share in zip(survivors, shares):
            if not share:
                continue
            if self.sent[s] and not core.config.lockstep:
                for off, size in share:
                    out.append(Send(s, ExtendPartition(off, size)))
                    self.sent[s].append((off, size))
            else:
                self.queued[s].extend(share)
                self._send_next(s, out)

    def coverage(self) -> tuple[int, list[tuple[int, list[Range]]]]:
        last = self.core.last_aggregated
        epochs: list[tuple[int, list[Range]]] = []
        if self.epoch > last:
            holes: list[Range] = []
            for r in range(self.core.ws):
                holes += self.sent[r] + list(self.queued[r])
            epochs.append((self.epoch, holes))
        return max(self.epoch + 1, last + 1), epochs

    def _shares(self, total: int, alive: Sequence[bool]) -> list[int]:
        """Batches per rank: fixed ratios, else by measured speed, else equal."""
        core = self.core
        ws = core.ws
        live = [r for r in range(ws) if alive[r]]
        ratios = core.config.partition_ratios
        if ratios is not None:
            return ratio_to_sizes(total, [ratios[r] if alive[r] else 0.0 for r in range(ws)])
        hints = core.config.speed_hints
        if core.policy is not Policy.SYNC and core.elche.calibrated:
            sub = throughput_sizes(total, [core.elche.smoothed_ms(r) for r in live])
        elif core.policy is not Policy.SYNC and hints is not None:
            sub = throughput_sizes(total, [1.0 / hints[r] for r in live])
        else:
            sub = equal_sizes(total, len(live)) if live else []
        sizes = [0] * ws
        for r, s in zip(live, sub):
            sizes[r] = s
        return sizes

    def _open_epoch(self, epoch: int, out: list[Out]) -> None:
        core = self.core
        core.epoch_hooks(epoch, out)
        holes = core.resume_holes.pop(epoch, None)
        bs = core.bs
        ranges = holes if holes is not None else [(0, core.config.epoch_batches(epoch) * bs)]
        total = sum(s for _, s in ranges) // bs
        alive = core.alive_mask()
        shares = split_ranges(ranges, [b * bs for b in self._shares(total, alive)])
        self.epoch = epoch
        for r in range(core.ws):
            self.sent[r] = []
            self.queued[r] = deque(shares[r])
            self.batches_done[r] = 0
            if alive[r]:
                self._send_next(r, out)

    def _send_next(self, r: int, out: list[Out]) -> None:
        if self.sent[r] or not self.queued[r]:
            return
        core = self.core
        if core.config.lockstep and (core.ledger.steps[r] > 0 or core.reduce.in_flight):
            # Lockstep: one batch per window; the next waits for this window's average
            # (``after_reduce``), so where rounds fall never depends on timing.
            return
        off, size = self.queued[r].popleft()
        if core.config.lockstep and size > core.bs:
            self.queued[r].appendleft((off + core.bs, size - core.bs))
            size = core.bs
        self.sent[r] = [(off, size)]
        self.batches_done[r] = 0
        out.append(Send(r, StartEpoch(EpochPlan(self.epoch, off, size))))


def _untrained(sent: list[Range], trained: int) -> list[Range]:
    """What of ``sent`` (in the order sent, trained front to back) is left after
    ``trained`` samples."""
    left: list[Range] = []
    for off, size in sent:
        done = min(trained, size)
        trained -= done
        if done < size:
            left.append((off + done, size - done))
    return left
