"""Dispatch strategy (reference §4.10): one interface (``dispatch_api``), two strategies,
chosen once.

``PoolDispatch`` (progressive, here): each epoch is a ``ChunkPool``; a rank gets its next
chunk when it reports the last one, sized by its ElChe count, and may stream into the
next epoch. ``PartitionDispatch`` (fixed partition, ``partition.py``): each epoch is cut
once into one share per rank; a rank holds one plan at a time, the rest of its share
queued, and a dead rank's remainder is split among the survivors.

Sans-IO like the core: effects are appended to ``out``, time comes in as ``now``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flodl_bus.coordinator import bridge
from flodl_bus.coordinator.chunk_pool import (
    ChunkPool,
    Range,
    final_window_alloc,
)
from flodl_bus.coordinator.config import Backend, Policy
from flodl_bus.coordinator.dispatch_api import Dispatch, DispatchCore
from flodl_bus.coordinator.effects import Out, Send
from flodl_bus.coordinator.tracked import Tracked
from flodl_bus.protocol.messages import (
    EpochPlan,
    MetricsMsg,
    StageAdvisory,
    StartEpoch,
)

MIN_CHUNK = 4


@dataclass(slots=True)
class FinalWindow:
    #: (ElChe counts generation, liveness generation) the split was built from
    key: tuple[int, int]
    slots: list[int]
    total: int


class PoolDispatch(Dispatch):
    """Progressive dispatch: one chunk in flight per rank, drawn from per-epoch pools."""

    def __init__(self, core: DispatchCore) -> None:
        super().__init__(core)
        self.pools: dict[int, ChunkPool] = {}
        self.final_windows: dict[int, FinalWindow] = {}
        self.rank_epoch = Tracked([core.start_epoch] * core.ws)
        #: ranks whose plan could not be sent: offered again on the next tick
        self.redispatch: list[int] = []
        #: a pool opened since the last advisories went out
        self._advise_due = False
        self._live_sum_key = (-1, -1)
        self._live_sum = 0
        #: cadence: a rank held idle by the reduce's wait is given more work (cpu-cadence
        #: with ``cpu_bridges``)
        self.bridges = bridge.applies(core.config)
        #: the owed waits a bridge is sized by, kept between bridges
        self._owed = bridge.OwedWaits()
        # The core's ``solo`` is not set yet: a world of one is read off the config.
        cfg = core.config
        #: a chunk capped by the rank's window count carries its next window as well
        #: (the CPU plane's bridges: work after the snapshot stays on the consensus)
        self._crosses = self.bridges and cfg.backend is Backend.CPU and cfg.chunks_cross_windows
        #: a world of one trains what is left of an epoch in one plan
        self._solo_epochs = (
            cfg.world_size == 1 and cfg.solo_without_rounds and cfg.solo_whole_epochs
        )
        #: no epoch barrier: no collective here that could mix two epochs (§6 #17)
        self.overlaps = cfg.epoch_overlap and (
            cfg.backend is Backend.CPU or (cfg.world_size == 1 and cfg.solo_without_rounds)
        )
        #: a world of one holds two plans, the epoch it trains and the next, so no epoch
        #: ends in a trip through Redis for the next plan (issue 27)
        self._ahead = self._solo_epochs and self.overlaps and cfg.solo_plans_ahead
        #: several ranks (cadence, async; sync keeps its lockstep rounds): a rank whose
        #: chunk ends its share of an epoch, its window not yet full, holds its first
        #: chunk of the next while it trains that one, for the same reason (issue 27)
        self._ahead_multi = (
            not self._solo_epochs
            and cfg.world_size > 1
            and self.overlaps
            and cfg.plans_ahead
            and cfg.policy is not Policy.SYNC
        )
        #: ranks sent a plan they have not begun (no Batch since): the plan ahead waits
        #: for their first Batch, so two StartEpochs never meet in the rank's one-plan
        #: mailbox (a world of one: only plans sent while it had none)
        self._unbegun = [False] * core.ws
        #: Batches of each rank since its last report: what it trained of the chunk it
        #: trains now (``_ahead_multi``: its window's budget counts the rest of it)
        self._trained = [0] * core.ws
        #: ranks refused a plan ahead only until a round frees their window: a round's
        #: ``_fill_idle`` asks these again, not every rank (at 1,024 ranks asking all of
        #: them added half to a round's cost, ``bench coordinator``)
        self._owed_ahead: set[int] = set()
        #: pools opened ahead of their epoch: their clock starts at the previous one's end
        #: (a world of one) or as a rank starts them (several ranks, ``_clock_starts``)
        self._ahead_pools: set[int] = set()

    def start(self, now: float, out: list[Out]) -> None:
        for r in range(self.core.ws):
            self.next_chunk(r, now, out)
        self._advise(out)

    def resume_at(self, epoch: int) -> None:
        self.rank_epoch = Tracked([epoch] * self.core.ws)

    def has_in_flight(self, r: int) -> bool:
        # A loop, not any() over a generator: the gate asks this of every short rank
        # it passes, for every recorded message (a third of the core's time at 1,024
        # ranks near an epoch's end, where most short ranks are idle).
        for p in self.pools.values():  # noqa: SIM110
            if p.has_in_flight(r):
                return True
        return False

    def in_flight(self, r: int) -> int:
        return sum(p.in_flight(r) for p in self.pools.values())

    def in_flight_all(self) -> list[int]:
        pools = list(self.pools.values())
        if not pools:
            return [0] * self.core.ws
        if len(pools) == 1:
            return pools[0].in_flight_all()
        return list(map(sum, zip(*(p.in_flight_all() for p in pools), strict=True)))

    def quiesced(self, r: int) -> bool:
        if self.has_in_flight(r):
            return False
        pool = self.pools.get(self.rank_epoch[r])
        if pool is None or pool.remaining() == 0:
            return True
        fw = self.final_windows.get(pool.epoch)
        return fw is not None and fw.slots[r] == 0

    def current_epoch(self) -> int:
        return max(self.rank_epoch)

    def rank_epochs(self) -> list[int]:
        return self.rank_epoch.copy()

    def rank_epochs_view(self) -> list[int]:
        return self.rank_epoch

    def in_flight_view(self) -> list[int]:
        # One pool (an epoch's steady state): its own tracked counts. Two (an epoch's
        # tail under overlap) or none: their sum, compared whole by the summary.
        if len(self.pools) == 1:
            return next(iter(self.pools.values())).in_flight_view()
        return self.in_flight_all()

    def remaining(self) -> dict[int, int]:
        pools = self.pools
        if len(pools) == 1:  # an epoch's steady state; asked by every state summary
            for e, p in pools.items():
                return {e: p.remaining()}
        return {e: p.remaining() for e, p in sorted(pools.items())}

    def epoch_remaining(self) -> int | None:
        if not self.pools:
            return None
        return self.pools[min(self.pools)].remaining() // self.core.bs

    def oldest_open_epoch(self) -> int | None:
        return min(self.pools) if self.pools else None

    def on_batch(self, r: int, now: float, out: list[Out]) -> None:
        if self._ahead_multi:
            self._trained[r] += 1
        if self._unbegun[r]:
            self._unbegun[r] = False
            if self.core.training:
                self._plan_ahead(r, now, out)

    def on_metrics(self, r: int, msg: MetricsMsg, now: float, out: list[Out]) -> None:
        pool = self.pools.get(msg.epoch)
        if pool is not None:
            pool.mark_completed(r, msg.samples_processed)
        if self._ahead or self._ahead_multi:
            # The plan held ahead is the one r trains now: its epoch is r's.
            held = [e for e, p in self.pools.items() if p.has_in_flight(r)]
            if held:
                self.rank_epoch[r] = min(held)
                if self._ahead_multi:
                    # Taken from the mailbox as r sent this report, begun at its first
                    # Batch; its epoch's clock starts now, as r starts it.
                    self._unbegun[r] = True
                    self._clock_starts(min(held), now)
        self._trained[r] = 0
        if self.core.training:
            self.next_chunk(r, now, out)
        self._advise(out)

    def rollback(self, r: int, plan: EpochPlan) -> None:
        bs = self.core.bs
        pool = self.pools.get(plan.epoch)
        if pool is None or not pool.rollback_take(r, plan.partition_offset, plan.partition_size):
            return
        fw = self.final_windows.get(plan.epoch)
        if fw is not None:
            fw.slots[r] += plan.partition_size // bs
            fw.total += plan.partition_size // bs
        # Re-offered on the next tick (not here: a dead link would spin).
        if r not in self.redispatch:
            self.redispatch.append(r)

    def retry(self, now: float, out: list[Out]) -> None:
        if self.redispatch and self.core.training:
            retry, self.redispatch = self.redispatch, []
            for r in retry:
                if not self.has_in_flight(r):
                    self.next_chunk(r, now, out)
                elif self._ahead_multi and not self._unbegun[r]:
                    self._plan_ahead(r, now, out)  # the plan ahead's send failed

    def aggregate_ready(self, now: float, out: list[Out]) -> bool:
        done_any = False
        for e in sorted(self.pools):
            pool = self.pools[e]
            if e != self.core.last_aggregated + 1 or not pool.is_epoch_done():
                break
            epoch_ms = (now - pool.created_at) * 1000.0
            del self.pools[e]
            self.final_windows.pop(e, None)
            ahead = self.pools.get(e + 1)
            if e + 1 in self._ahead_pools and ahead is not None:
                # Opened while e trained: its epoch_ms counts from e's end, not from then.
                self._ahead_pools.discard(e + 1)
                ahead.created_at = now
            self.core.publish_epoch(e, epoch_ms, out)
            done_any = True
        return done_any

    def advance(self, now: float, out: list[Out], aggregated: bool) -> None:
        if aggregated and self.core.training:
            self._fill_idle(now, out)
        self._advise(out)

    def _fill_idle(self, now: float, out: list[Out]) -> None:
        for r in range(self.core.ws):
            if not self.has_in_flight(r):
                self.next_chunk(r, now, out)
            elif self._ahead and not self._unbegun[r]:
                self._plan_ahead(r, now, out)
        if self._owed_ahead:
            for r in sorted(self._owed_ahead):
                if not self._unbegun[r]:
                    self._plan_ahead(r, now, out)

    def reassign(self, r: int, remainder: list[Range], now: float, out: list[Out]) -> None:
        for e in sorted(self.pools):
            self.pools[e].forfeit(r)
        self._fill_idle(now, out)

    def plans_for_update(self, now: float, out: list[Out]) -> dict[int, EpochPlan]:
        if self.core.policy is not Policy.CADENCE:
            return {}
        # Atomic dispatch: the next chunk rides the Update, so a rank never idles between
        # adopting the consensus and receiving work.
        plans: dict[int, EpochPlan] = {}
        for r in range(self.core.ws):
            plan = self.next_chunk(r, now, out, via_update=True)
            if plan is not None:
                plans[r] = plan
        return plans

    def prefetch(self, now: float, out: list[Out]) -> None:
        if self.core.training:
            self._fill_idle(now, out)

    def after_reduce(self, now: float, out: list[Out]) -> None:
        if self.core.training:
            # A rank parked in wait_for_epoch_plan sends nothing, so nothing else would
            # ever dispatch to it; its StartEpoch queues behind the reduce's messages.
            self._fill_idle(now, out)
        self._advise(out, force=True)

    def coverage(self) -> tuple[int, list[tuple[int, list[Range]]]]:
        epochs = [(e, self.pools[e].uncovered_ranges()) for e in sorted(self.pools)]
        next_epoch = max(self.pools) + 1 if self.pools else self.core.last_aggregated + 1
        return next_epoch, epochs

    # ------------------------------------------------------------- stage advisories
    def _advise(self, out: list[Out], force: bool = False) -> None:
        """Tell each live rank what it will likely train next (prefetch hints), at an
        epoch's start and after every reduce (§4.10.7)."""
        core = self.core
        if not core.config.stage_advisories or not (force or self._advise_due):
            return
        self._advise_due = False
        if not core.training or not self.pools:
            return
        counts = tuple(core.elche.counts)
        for r in range(core.ws):
            if core.alive(r):
                out.append(Send(r, StageAdvisory(counts, self.segments(r))))

    def segments(self, r: int) -> tuple[tuple[int, tuple[Range, ...]], ...]:
        """Per open epoch: ``r``'s unconsumed span, then the tail of every other span it
        may steal (its count of batches each, taken from the end as steals are), then
        its predicted span of the next epoch."""
        core = self.core
        margin = max(core.elche.counts[r], 1) * core.bs
        out: list[tuple[int, tuple[Range, ...]]] = []
        for e in sorted(self.pools):
            pool = self.pools[e]
            own = pool.residue_range(r)
            ranges = [own] if own[1] > 0 else []
            for s in range(pool.world_size):
                if s == r:
                    continue
                start, size = pool.residue_range(s)
                take = min(margin, size)
                if take > 0:
                    ranges.append((start + size - take, take))
            out.append((e, tuple(ranges)))
        nxt = max(self.pools) + 1
        if nxt < core.config.num_epochs and nxt not in self.pools:
            batches = core.config.epoch_batches(nxt)
            weights = self._pool_weights()
            span = ChunkPool.create(nxt, batches, core.bs, weights).residue_range(r)
            if span[1] > 0:
                out.append((nxt, (span,)))
        return tuple(out)

    # ------------------------------------------------------------- choosing a chunk
    def _live_counts_sum(self) -> int:
        core = self.core
        key = (core.elche.generation, core.live.generation)
        if key != self._live_sum_key:
            self._live_sum = sum(c for c, a in zip(core.elche.counts, core.live.alive) if a)
            self._live_sum_key = key
        return self._live_sum

    def _budget(self, r: int) -> int:
        core = self.core
        extra = core.max_overshoot if core.policy is Policy.ASYNC else 0
        return core.elche.counts[r] + extra

    def _pool_weights(self) -> list[float]:
        alive = self.core.alive_mask()
        if self.core.elche.calibrated or self.core.config.speed_hints is not None:
            # Hinted counts stand in for measured ones until the first calibration.
            return [float(c) if a else 0.0 for c, a in zip(self.core.elche.counts, alive)]
        return [1.0 if a else 0.0 for a in alive]

    def _get_pool(
        self, epoch: int, now: float, out: list[Out], *, ahead: bool = False
    ) -> ChunkPool:
        core = self.core
        pool = self.pools.get(epoch)
        if pool is None:
            # Several ranks on the CPU plane score an epoch's start on the consensus of
            # the next round (``CpuReduce.schedule_eval``): nothing to arm ahead.
            core.epoch_hooks(epoch, out, armed=ahead and self._solo_epochs)
            if ahead:
                self._ahead_pools.add(epoch)
            holes = core.resume_holes.pop(epoch, None)
            if holes is not None:
                pool = ChunkPool.from_coverage(epoch, holes, core.ws, now)
            else:
                batches = core.config.epoch_batches(epoch)
                pool = ChunkPool.create(epoch, batches, core.bs, self._pool_weights(), now)
            self.pools[epoch] = pool
            self._advise_due = True
        return pool

    def next_chunk(
        self, r: int, now: float, out: list[Out], via_update: bool = False
    ) -> EpochPlan | None:
        core = self.core
        if not core.alive(r) or not core.training:
            return None
        # One chunk in flight per rank: the rank has a single pending-plan slot, and a
        # second plan would overwrite an unconsumed one and wedge the epoch (§6 #1). A
        # world of one's plan ahead is sent once the first is out of that slot.
        if self.has_in_flight(r):
            return None
        plan = self._draw(r, now, out, via_update)
        if plan is not None and self._ahead and not via_update:
            self._unbegun[r] = True
        elif plan is not None and self._ahead_multi:
            self._unbegun[r] = True
            self._clock_starts(plan.epoch, now)
            if self.pools[plan.epoch].remaining() == 0:
                # The epoch handed out its last chunk: a rank training one of its chunks
                # now trains its last share of it, and may hold its next plan.
                for s in range(self.core.ws):
                    if s != r and not self._unbegun[s]:
                        self._plan_ahead(s, now, out)
        return plan

    def _plan_ahead(self, r: int, now: float, out: list[Out]) -> EpochPlan | None:
        """A world of one's next epoch, in one plan, while it trains what is left of the
        current one: it reaches the rank's mailbox during that epoch, so the epoch's last
        step is followed by the next one's first without a trip through Redis. Sent only
        once the rank trains its plan (a Batch since it went out); the eval the epoch's
        start owes rides ahead of it, armed (``ArmEpochEval``); an epoch whose start takes
        a checkpoint is not planned ahead (the save is of the model at that start).

        Several ranks (``_ahead_multi``): the first chunk of the next epoch, for a rank
        whose chunk ends its share of the current one (nothing left in it, or nothing
        for it in the epoch's last window) with steps of its window to spare. One whose
        window the chunk fills gets its next chunk from the round that closes it
        (``prefetch``, ``plans_for_update``)."""
        core = self.core
        self._owed_ahead.discard(r)
        held = [e for e, p in self.pools.items() if p.has_in_flight(r)]
        if not core.alive(r) or len(held) != 1:
            return None
        cur = self.pools[held[0]]
        if cur.remaining() > 0 and not (self._ahead_multi and self._left_out(r, cur)):
            return None
        nxt = held[0] + 1
        if nxt >= core.config.num_epochs or nxt > core.last_aggregated + 2:
            return None
        budget = 0
        if self._ahead_multi:
            # The ledger holds what r trained of its chunk so far: the rest of it counts
            # against its window too.
            budget = self._budget(r) - (cur.in_flight(r) // core.bs - self._trained[r])
            # Crossing windows, the next window may ride ahead too (``_chunk_batches``).
            room = budget + core.elche.counts[r] if self._crosses else budget
            if core.ledger.steps[r] >= room:
                self._owed_ahead.add(r)  # asked again as a round frees its window
                return None
        if nxt not in self.pools and not core.hooks_armable(nxt):
            return None
        pool = self._get_pool(nxt, now, out, ahead=True)
        if pool.remaining() == 0:
            return None
        # ``rank_epoch`` stays the epoch r trains (status, the saves' epoch) until it
        # reports it (``on_metrics``). Sized as any chunk (a world of one's: the epoch).
        batches = self._chunk_batches(r, pool, budget)
        return self._take(r, pool, batches, out, via_update=False) if batches > 0 else None

    def _clock_starts(self, epoch: int, now: float) -> None:
        """Several ranks: a pool opened ahead counts its epoch from when a rank starts
        it (as one opened by the rank's draw does), not from when the plan went out."""
        if epoch in self._ahead_pools:
            self._ahead_pools.discard(epoch)
            self.pools[epoch].created_at = now

    def _draw(self, r: int, now: float, out: list[Out], via_update: bool) -> EpochPlan | None:
        core = self.core
        budget = self._budget(r)
        bridging = False
        # A world of one's windows close without a round: its budget never holds its
        # next epoch back (records made before the overlap waited for the window's close).
        if core.ledger.steps[r] >= budget and not (self._solo_epochs and self.overlaps):
            if not self.overlaps:
                return self._bridge(r, out, via_update)
            # No epoch barrier (the CPU plane): a bridge is drawn as any chunk of r is,
            # from the oldest epoch with work for it, the next one included.
            if not self._bridge_wanted(r, via_update):
                return None
            bridging = True
        num_epochs = core.config.num_epochs
        epoch = self.rank_epoch[r]
        if self.overlaps:
            epoch = self.rank_epoch[r] = self._oldest_with_work(r, epoch)
        pool = self.pools.get(epoch)
        if pool is None and core.last_aggregated < epoch < num_epochs:
            pool = self._get_pool(epoch, now, out)
        if pool is None or pool.remaining() == 0 or self._left_out(r, pool):
            nxt = max(epoch + 1, core.last_aggregated + 1)
            if nxt >= num_epochs:
                return None
            live_older = any(e < nxt for e in self.pools)
            # Epoch barrier: a barrier-paced rank never streams into the next epoch while
            # an older one is still in flight (§6 #17), unless nothing can mix the two.
            if core.config.barrier_paced and live_older and not self.overlaps:
                return None
            if nxt > core.last_aggregated + 2:
                return None
            pool = self._get_pool(nxt, now, out)
            self.rank_epoch[r] = nxt
            epoch = nxt
            if pool.remaining() == 0:
                return None
        if bridging:
            size = bridge.batches(core, self, r, next_window=True, index=self._owed)
            batches = min(size, pool.remaining() // core.bs)
            return self._take(r, pool, batches, out, via_update) if batches > 0 else None
        batches = self._chunk_batches(r, pool, budget)
        if batches <= 0:
            return self._bridge(r, out, via_update)
        return self._take(r, pool, batches, out, via_update)

    def _oldest_with_work(self, r: int, epoch: int) -> int:
        """Without the barrier a rank may have moved on while an older epoch still holds
        work for it (its last window re-pinned as counts or liveness changed): that work
        comes first, or nobody might ever take it."""
        for e in sorted(self.pools):
            if e >= epoch:
                break
            pool = self.pools[e]
            if pool.remaining() >= self.core.bs and not self._left_out(r, pool):
                return e
        return epoch

    def _left_out(self, r: int, pool: ChunkPool) -> bool:
        """The epoch's last window is pinned and has no slot for ``r``: with the epoch
        barrier lifted it moves on to the next epoch instead of idling to its end."""
        if not self.overlaps or not self.core.config.barrier_paced:
            return False
        fw = self._refresh_final_window(pool, pool.remaining() // self.core.bs)
        return fw is not None and fw.slots[r] == 0

    def _take(
        self, r: int, pool: ChunkPool, batches: int, out: list[Out], via_update: bool
    ) -> EpochPlan | None:
        core = self.core
        epoch = pool.epoch
        got = pool.take_chunk(batches * core.bs, r)
        if got is None:
            return None
        fw = self.final_windows.get(epoch)
        if fw is not None:
            used = min(fw.slots[r], got[1] // core.bs)
            fw.slots[r] -= used
            fw.total -= used
        plan = EpochPlan(epoch, got[0], got[1])
        if not via_update:
            out.append(Send(r, StartEpoch(plan)))
        return plan

    def _bridge(self, r: int, out: list[Out], via_update: bool) -> EpochPlan | None:
        """A chunk of ``r``'s own epoch (never past the barrier, §6 #17) while the
        reduce waits on a slower rank (``coordinator.bridge``)."""
        core = self.core
        if not self.bridges or via_update:
            return None
        pool = self.pools.get(self.rank_epoch[r])
        if pool is None or pool.remaining() < core.bs or not self._bridge_wanted(r, via_update):
            return None
        size = min(bridge.batches(core, self, r, index=self._owed), pool.remaining() // core.bs)
        return self._take(r, pool, size, out, via_update)

    def _bridge_wanted(self, r: int, via_update: bool) -> bool:
        # Never on an Update: the round it rides has closed, and with it the window.
        if not self.bridges or via_update or not bridge.wanted(self.core, r):
            return False
        # A cpu gate shut only by the round in flight opens as that round ends, and the
        # next round's trigger hands r its chunk: a bridge then would only hold that
        # chunk back behind a batch and a round trip.
        return self.core.config.backend is Backend.NCCL or bridge.owes_any(self.core, self, r)

    def _chunk_batches(self, r: int, pool: ChunkPool, budget: int) -> int:
        core = self.core
        remaining = pool.remaining() // core.bs
        if remaining <= 0:
            return 0
        if self._solo_epochs:
            # A world of one has no round to wait for and no peer to share with: what is
            # left of the epoch goes in one plan, so the rank never idles between chunks
            # (each turn-over is a trip through Redis and back, issue 27). Its windows
            # still close as its Batches arrive.
            return remaining
        barrier_paced = core.config.barrier_paced
        if barrier_paced:
            fw = self._refresh_final_window(pool, remaining)
            if fw is not None:
                return fw.slots[r]
        counts = core.elche.counts
        if self._crosses:
            # The round the count triggers reaches the rank mid-chunk: what it trains
            # past its count before its snapshot is in the snapshot, weighed by its true
            # steps, and what it trains after counts in its next window (as a bridge).
            left = max(budget - core.ledger.steps[r], 0) + counts[r]
        else:
            left = max(budget - core.ledger.steps[r], 1)
        live_sum = self._live_counts_sum()
        if remaining < live_sum or barrier_paced:
            return min(left, remaining) if self._crosses else min(counts[r], remaining, left)
        if not core.elche.calibrated:
            probe = max(core.config.epoch_batches(pool.epoch) // (core.ws * 10), MIN_CHUNK)
            return min(probe, remaining, left)
        share = math.ceil(remaining * counts[r] / max(live_sum, 1))
        return min(max(share, MIN_CHUNK), remaining, left)

    def _refresh_final_window(self, pool: ChunkPool, remaining: int) -> FinalWindow | None:
        core = self.core
        key = (core.elche.generation, core.live.generation)
        fw = self.final_windows.get(pool.epoch)
        # A pinned split stays valid while the counts and liveness it was built from
        # hold and its slots still sum to what is left; otherwise re-pin from the live
        # remainder (a stale pin can leave a zero-slot rank the gate waits for, §6 #34).
        if fw is not None and fw.key == key and fw.total == remaining:
            return fw
        if remaining < self._live_counts_sum() + core.live.active_count:
            slots = final_window_alloc(remaining, core.elche.counts, core.live.alive)
            fw = FinalWindow(key, slots, remaining)
            self.final_windows[pool.epoch] = fw
            return fw
        self.final_windows.pop(pool.epoch, None)
        return None
