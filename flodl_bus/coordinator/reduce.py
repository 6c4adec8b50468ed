"""The reduce cycle (reference §4.3 to §4.8): one interface, two backends, chosen once.

``SoloReduce``: a world of one rank, whatever the backend; the average of one model is
that model, so a window closes in the coordinator alone, with no message to the rank.
``NcclReduce``: ``SyncNow``, the ranks block in the collective and ack with their next
step; the cycle closes in the call that opened it. ``CpuReduce``: ``RequestParams``, each
rank's snapshot is reduced in the background and its ``SyncAck`` is the ack; the cycle
closes in a later ``tick`` with an ``Update`` per rank. What both share (closing the
window: ElChe, the trend guard, the version) is ``Reduce``'s.

Sans-IO like the core: effects are appended to ``out``, time comes in as ``now``.
"""

from __future__ import annotations

from typing import Protocol

from flodl_bus.coordinator.checkpoint import ArmedSave
from flodl_bus.coordinator.config import Policy
from flodl_bus.coordinator.effects import Alert, Broadcast, Out, Send
from flodl_bus.coordinator.elche import WindowReport
from flodl_bus.coordinator.guard import Verdict, VerdictKind, merge
from flodl_bus.coordinator.ledger import Ledger
from flodl_bus.coordinator.liveness import Liveness
from flodl_bus.coordinator.tracked import Tracked
from flodl_bus.coordinator.views import Controllers
from flodl_bus.protocol.messages import (
    ArmConsensusEval,
    DeclareDead,
    EpochPlan,
    ExecuteEvalCallback,
    RequestParams,
    SaveReason,
    SetGlobalStep,
    SyncAck,
    SyncNow,
    Throttle,
    WireUpdate,
)


class _Dispatch(Protocol):
    """What a round asks of the dispatch."""

    @property
    def barrier_on_reduce(self) -> bool: ...
    def current_epoch(self) -> int: ...
    def epoch_remaining(self) -> int | None: ...
    def oldest_open_epoch(self) -> int | None: ...
    def has_in_flight(self, r: int) -> bool: ...
    def plans_for_update(self, now: float, out: list[Out]) -> dict[int, EpochPlan]: ...
    def after_reduce(self, now: float, out: list[Out]) -> None: ...


class _Checkpoints(Protocol):
    """What a round asks of the checkpoints: the save it armed, once it closed."""

    def finish(self, armed: ArmedSave | None, out: list[Out]) -> None: ...


class ReduceCore(Controllers, Protocol):
    """The core as a round sees it: the run's counters and controllers, the verdict it
    leaves, and the window, the liveness and the two sibling parts it calls (the part
    imports no core back; the core and its parts form a tree)."""

    last_verdict: Verdict

    @property
    def policy(self) -> Policy: ...
    @property
    def live(self) -> Liveness: ...
    @property
    def ledger(self) -> Ledger: ...
    @property
    def last_lr(self) -> list[float | None]: ...
    @property
    def training(self) -> bool: ...
    @property
    def dispatch(self) -> _Dispatch: ...
    @property
    def checkpoints(self) -> _Checkpoints: ...
    def alive_mask(self) -> list[bool]: ...
    def shutdown_with_save(self, reason: SaveReason, out: list[Out]) -> None: ...


OVERSHOOT_START = 3
OVERSHOOT_CEILING = 15
#: callback slack is staged only when it is at least this share of a window, and 100 ms
SLACK_SHARE = 0.05
SLACK_FLOOR_MS = 100.0


def _every(every: int | None, epoch: int) -> bool:
    return bool(every) and epoch % (every or 1) == 0


class Reduce:
    """What both backends share: the per-rank reports of a round and closing a window."""

    #: fewest live ranks the backend can go on with (a cpu "group" of one averages alone)
    min_survivors = 1
    #: the final eval scores the consensus (cpu) rather than the live model (nccl)
    adopts_consensus = False

    def __init__(self, core: ReduceCore) -> None:
        self.core = core
        ws = core.ws
        # Tracked (as every per-rank list the state summary shows): the summary reads
        # only the entries written since it last looked.
        self.last_step_count = Tracked([0] * ws)
        self.divergence: list[float | None] = [None] * ws
        self.pre_norm: list[float | None] = [None] * ws
        self.post_norm: float | None = None
        self.upload_ms: list[float | None] = [None] * ws
        self.throttled = Tracked([False] * ws)
        #: when the open gate started waiting for the window to complete (NCCL cadence)
        self.wait_since: float | None = None

    # ------------------------------------------------------------- the backend's rules
    @property
    def in_flight(self) -> bool:
        """A cycle is open and the gate stays shut until it closes."""
        return False

    def blocks(self, r: int) -> bool:
        """Rank ``r`` holds the gate for this backend's own reason."""
        return False

    def any_blocks(self) -> bool:
        """False only if ``blocks`` holds for no rank (then the gate needs not ask)."""
        return False

    def settled(self) -> bool:
        """No rank is inside a collective (Shutdown may go out)."""
        return True

    def acks(self) -> list[bool]:
        raise NotImplementedError

    def ack_flags(self) -> list[bool]:
        """What ``acks`` copies, itself (read, never written, by the state summary)."""
        return self.acks()

    def on_batch(self, r: int, step_count: int, now: float) -> None:
        if step_count > self.last_step_count[r]:
            self.last_step_count[r] = step_count

    def on_sync_ack(self, r: int, msg: SyncAck, now: float) -> None:
        # Never a step: counting it would advance global_step (and the LR) early.
        self.divergence[r] = msg.divergence
        self.pre_norm[r] = msg.pre_norm
        if self.post_norm is None:
            self.post_norm = msg.post_norm

    def on_snapshot_ready(self, r: int, now: float) -> None:
        pass

    def on_gone(self, r: int, out: list[Out], *, exiting: bool) -> None:
        """``r`` died or left: it will never ack."""
        if not exiting:
            self.throttled[r] = False

    def schedule_eval(self, epoch: int, out: list[Out]) -> None:
        raise NotImplementedError

    def trigger(self, now: float, closed: Ledger, armed: ArmedSave | None, out: list[Out]) -> None:
        raise NotImplementedError

    def poll(self, now: float, out: list[Out]) -> None:
        pass

    def check_throttle(self, out: list[Out]) -> None:
        pass

    def measures_delivered(self) -> bool:
        """Whether a window's delivered (marginal) times are comparable across ranks."""
        return self.core.policy is not Policy.SYNC

    def window_ready(self, now: float, window: Ledger) -> bool:
        """The gate is open: whether to reduce now or wait for the window to complete."""
        return True

    def window_waits(self, window: Ledger) -> bool:
        """An open gate would wait for ``window`` to complete (no side effect)."""
        return False

    # ------------------------------------------------------------- closing a window
    def _movers(self, window: Ledger) -> list[int]:
        steps = window.steps
        return [r for r in self.core.live.alive_ranks() if steps[r] > 0]

    @staticmethod
    def _has_delivered(window: Ledger, r: int) -> bool:
        # Callback time taken out of the window can leave batches with no time left.
        return window.delivered_batches[r] > 0 and window.delivered_ms[r] > 0

    def movers_delivered_complete(self, window: Ledger) -> bool:
        """Every live rank that stepped in ``window`` has a delivered (marginal) sample;
        idle and dead ranks do not count. A one-batch window has none: its only batch is
        the fill."""
        return all(self._has_delivered(window, r) for r in self._movers(window))

    def timing_feed(self, window: Ledger) -> tuple[list[float], list[int]]:
        """Per rank (ms, batches) ElChe learns the window from: the delivered scale
        (compute + data wait, fill excluded) where the mode measures it and every mover
        has a sample, else the compute scale for every rank. All or none: a mix makes a
        data-starved rank look fast and hands it the most work (§6 #15)."""
        return self._feed(window)[1:]

    def _feed(self, window: Ledger) -> tuple[bool, list[float], list[int]]:
        if self.measures_delivered() and self.movers_delivered_complete(window):
            return True, list(window.delivered_ms), list(window.delivered_batches)
        return False, list(window.wall_ms), list(window.steps)

    def window_report(self, closed: Ledger, reduce_ms: float) -> WindowReport:
        core = self.core
        delivered, feed_ms, feed_batches = self._feed(closed)
        ms: list[float | None] = [None] * core.ws
        fill = [0.0] * core.ws
        for r in self._movers(closed):
            if feed_batches[r] <= 0:
                continue
            ms[r] = per_batch = feed_ms[r] / feed_batches[r]
            first = closed.first_batch_ms[r]
            if delivered and first is not None:
                fill[r] = max(first - per_batch, 0.0)
        return WindowReport(tuple(ms), reduce_ms=reduce_ms, fill_ms=tuple(fill))

    def close_window(self, closed: Ledger, reduce_ms: float, out: list[Out]) -> None:
        """The reduce happened: ElChe learns the window, the guard judges it, version+1."""
        core = self.core
        self._stage_slack()
        was_calibrated = core.elche.calibrated
        core.elche.report_window(self.window_report(closed, reduce_ms))
        if not was_calibrated and core.elche.calibrated:
            alive = core.alive_mask()
            core.roles.elect_fastest(core.elche.fastest(alive), alive)
        guard = core.guard.report(
            [self.divergence[r] if core.alive(r) else None for r in range(core.ws)],
            max(closed.steps, default=0),
        )
        nudge = core.meta.observe(
            [core.last_lr[r] if core.alive(r) else None for r in range(core.ws)],
            core.elche.anchor,
            guard,
            core.elche.phase,
        )
        core.last_verdict = verdict = merge(guard, nudge)
        core.version += 1
        core.avg_count += 1
        # Relax-up lengthens windows only where ranks overshoot them anyway (async).
        relax_up = core.policy is Policy.ASYNC and core.config.relax_up
        anchor = core.elche.anchor
        if core.config.meta_then_guard:
            # flodl's order: the meta-controller's nudge (which drops this window's
            # growth proposal), then the guard's verdict as if alone: a Stable still
            # counts toward re-arming growth and relaxes async windows, a guard nudge
            # shrinks the anchor again.
            if nudge is not None and nudge.kind is VerdictKind.NUDGE_DOWN:
                core.elche.apply_verdict(nudge)
            core.elche.apply_verdict(guard, relax_up=relax_up)
            overshoot_by = guard
        else:
            core.elche.apply_verdict(verdict, relax_up=relax_up)
            overshoot_by = verdict
        if verdict.kind is VerdictKind.NUDGE_DOWN:
            # flodl's drift alert: the replicas drifted (or the LR dropped) enough to
            # shorten the windows.
            why = [*core.meta.fired, *(["guard"] if guard.kind is VerdictKind.NUDGE_DOWN else [])]
            detail = f"anchor {anchor} -> {core.elche.anchor} ({', '.join(why)})"
            out.append(Alert("warn", "drift", detail))
        if core.overshoot_auto:
            # The guard's verdict moves the overshoot budget (a meta nudge never resets
            # it, in flodl's order).
            if overshoot_by.kind is VerdictKind.STABLE:
                core.max_overshoot = min(core.max_overshoot + 1, OVERSHOOT_CEILING)
            elif overshoot_by.kind is VerdictKind.NUDGE_DOWN:
                core.max_overshoot = OVERSHOOT_START
        core.global_step += sum(closed.steps)

    def _stage_slack(self) -> None:
        """The epoch's last window: each rank that runs a callback at the epoch's end
        (epoch_fn on its role, checkpoint and eval on theirs when due) gets a window
        shorter by the callbacks' expected time, where that time is worth it (§4.13.4)."""
        core = self.core
        elche = core.elche
        if not core.config.callback_slack or not elche.calibrated:
            return
        remaining = core.dispatch.epoch_remaining()
        epoch = core.dispatch.oldest_open_epoch()
        if remaining is None or epoch is None or remaining == 0 or remaining > sum(elche.counts):
            return
        cfg, roles = core.config, core.roles
        nxt = epoch + 1
        due = (
            (roles.epoch_callback, "epoch_fn", True),
            (roles.checkpoint, "checkpoint", _every(cfg.checkpoint_every, nxt)),
            (roles.eval, "eval", _every(cfg.eval_every, nxt)),
        )
        slack = [0.0] * core.ws
        for rank, kind, fires in due:
            ms = roles.ewma_ms[kind]
            if fires and ms is not None and core.alive(rank):
                slack[rank] += ms
        slow = elche.smoothed_ms(elche.anchor_rank) if elche.anchor_rank is not None else None
        anchor_wall_ms = elche.anchor * slow if slow is not None else 0.0
        threshold = max(SLACK_SHARE * anchor_wall_ms, SLACK_FLOOR_MS)
        slack = [s if s >= threshold else 0.0 for s in slack]
        if any(slack):
            elche.stage_slack(slack)

    def after_window(self, now: float, out: list[Out]) -> None:
        self.throttled = Tracked([False] * self.core.ws)
        self.divergence = [None] * self.core.ws
        self.pre_norm = [None] * self.core.ws
        self.post_norm = None
        self.core.dispatch.after_reduce(now, out)


class SoloReduce(Reduce):
    """A world of one: a window closes without a round (no SyncNow, no RequestParams).

    The average over one rank is its own model, so a round would only cost the rank a
    control message, a parameter pass for its norms and an ack (11% of a one-GPU
    cifar_resnet run under nccl-sync, issue 19). What a window feeds in the coordinator
    (ElChe, the guard, the version, the global step, an armed checkpoint) still happens.
    The rank is sent no ``SetGlobalStep``: its step counter is never reset by a round,
    so ``global_step + steps_since_avg`` already places its LR, and the global step would
    count the window twice. A resumed run still starts from the saved global step.
    """

    def __init__(self, core: ReduceCore, *, adopts_consensus: bool) -> None:
        super().__init__(core)
        self.adopts_consensus = adopts_consensus

    def acks(self) -> list[bool]:
        return [True] * self.core.ws

    def schedule_eval(self, epoch: int, out: list[Out]) -> None:
        # The live model is the consensus: it is scored at the epoch's start, as nccl's.
        roles = self.core.roles
        roles.pending_eval_intent = False
        out.append(Send(roles.eval, ExecuteEvalCallback(epoch, epoch, roles.eval)))

    def trigger(self, now: float, closed: Ledger, armed: ArmedSave | None, out: list[Out]) -> None:
        self.close_window(closed, 0.0, out)
        self.core.checkpoints.finish(armed, out)
        self.after_window(now, out)


class NcclReduce(Reduce):
    """The NCCL ack protocol (§4.4, §4.6.1)."""

    min_survivors = 2

    def __init__(self, core: ReduceCore) -> None:
        super().__init__(core)
        ws = core.ws
        #: each rank's step when SyncNow went out; a later step is its ack
        self.sync_step = [0] * ws
        self.acked = Tracked([True] * ws)
        #: entries of ``acked`` that are False, live rank or not: the gate asks
        #: ``any_blocks`` for every recorded message, and comparing the whole list was an
        #: O(ws) pass each time (2.5 us at 4,096 ranks)
        self._missing = 0
        #: live ranks whose ack is missing (a counter: a per-ack scan is O(ws) per ack)
        self.unacked = 0
        self.armed = False
        self.started_at = 0.0
        self.last_sync_ms = 0.0
        # With bridges only the SyncAck acks, never a Batch (flodl takes either): a
        # bridging rank trains until the SyncNow reaches it, so a Batch arriving after
        # the trigger may have been trained before the collective, with a step above the
        # coordinator's snapshot. The rank sends its SyncAck right after the collective,
        # before any later batch.
        self.acks_on_batch = not core.config.bridge_idle

    def blocks(self, r: int) -> bool:
        return not self.acked[r]

    def any_blocks(self) -> bool:
        # Any missing ack, live rank or not: ``acked`` is written only by the trigger
        # (counted there) and ``_settle``, so the count is exact.
        return self._missing > 0

    def settled(self) -> bool:
        return self.unacked == 0

    def acks(self) -> list[bool]:
        return self.acked.copy()

    def ack_flags(self) -> list[bool]:
        return self.acked

    def on_batch(self, r: int, step_count: int, now: float) -> None:
        super().on_batch(r, step_count, now)
        if self.acks_on_batch and not self.acked[r] and step_count > self.sync_step[r]:
            self._ack(r, now)

    def on_sync_ack(self, r: int, msg: SyncAck, now: float) -> None:
        super().on_sync_ack(r, msg, now)
        if msg.step_count > self.last_step_count[r]:
            self.last_step_count[r] = msg.step_count
        if not self.acked[r] and msg.step_count > self.sync_step[r]:
            self._ack(r, now)

    def _ack(self, r: int, now: float) -> None:
        self._settle(r)
        if self.armed and self.settled():
            self.armed = False
            self.last_sync_ms = (now - self.started_at) * 1000.0

    def _settle(self, r: int) -> None:
        if not self.acked[r]:
            self.acked[r] = True
            self.unacked -= 1
            self._missing -= 1

    def on_gone(self, r: int, out: list[Out], *, exiting: bool) -> None:
        super().on_gone(r, out, exiting=exiting)
        if exiting and self.armed and not self.acked[r]:
            # A rank that left mid-reduce strands its peers in the collective.
            out.append(Broadcast(DeclareDead(r)))
        self._settle(r)
        if self.armed and self.settled():
            self.armed = False

    def schedule_eval(self, epoch: int, out: list[Out]) -> None:
        roles = self.core.roles
        roles.pending_eval_intent = False
        out.append(Send(roles.eval, ExecuteEvalCallback(epoch, epoch, roles.eval)))

    def measures_delivered(self) -> bool:
        return self.core.policy is Policy.CADENCE

    def window_ready(self, now: float, window: Ledger) -> bool:
        """Progressive cadence waits, before SyncNow, for a mover still short of a
        delivered sample while its chunk is out (§4.6.1): the rest of that chunk may
        complete the sample, and a window reduced without it feeds ElChe the compute
        scale. Bounded by ``heartbeat_timeout + 2 s`` (0.1 s without the elastic sweep,
        where a silent rank is never found dead); ticks go on meanwhile, so the
        coordinator's heartbeat does too. The reference also waits out its ceiling for
        a mover whose chunk has come back; nothing more arrives for this window then."""
        cfg = self.core.config
        if not self.window_waits(window):
            self.wait_since = None
            return True
        if self.wait_since is None:
            self.wait_since = now
        ceiling = cfg.heartbeat_timeout + 2.0 if cfg.elastic else 0.1
        if now - self.wait_since >= ceiling:
            self.wait_since = None
            return True
        return False

    def window_waits(self, window: Ledger) -> bool:
        cfg = self.core.config
        if not (cfg.window_wait and cfg.policy is Policy.CADENCE and cfg.is_progressive):
            return False
        dispatch = self.core.dispatch
        return any(
            dispatch.has_in_flight(r)
            for r in self._movers(window)
            if not self._has_delivered(window, r)
        )

    def trigger(self, now: float, closed: Ledger, armed: ArmedSave | None, out: list[Out]) -> None:
        core = self.core
        self.sync_step = list(self.last_step_count)
        self.acked = Tracked([not a for a in core.alive_mask()])
        self._missing = self.acked.count(False)
        self.unacked = core.live.active_count
        self.armed = True
        self.started_at = now
        out.append(Broadcast(SyncNow()))
        # Ranks block in the collective: nothing else can move before they return, so
        # the cycle finishes in the same call (§4.6.1).
        self.close_window(closed, self.last_sync_ms, out)
        out.append(Broadcast(SetGlobalStep(core.global_step)))
        core.checkpoints.finish(armed, out)
        self.after_window(now, out)

    def poll(self, now: float, out: list[Out]) -> None:
        if not self.armed or self.settled():
            return
        if now - self.started_at > self.core.config.stall_ceiling:
            out.append(Alert("critical", "reduce_stall", "SyncNow never acked"))
            self.armed = False
            self.core.shutdown_with_save(SaveReason.REDUCE_STALL, out)


class CpuReduce(Reduce):
    """The CPU averaging cycle (§4.6): snapshots reduced off the ranks' training path."""

    adopts_consensus = True

    def __init__(self, core: ReduceCore) -> None:
        super().__init__(core)
        self.started_at: float | None = None
        self.acked = Tracked([False] * core.ws)
        #: the window the open cycle closes, and the save armed with it
        self._closing: Ledger | None = None
        self._armed: ArmedSave | None = None
        #: epoch whose eval waits for the next round's consensus
        self.eval_due: int | None = None

    @property
    def in_flight(self) -> bool:
        return self.started_at is not None

    def acks(self) -> list[bool]:
        return self.acked.copy()

    def ack_flags(self) -> list[bool]:
        return self.acked

    def on_sync_ack(self, r: int, msg: SyncAck, now: float) -> None:
        super().on_sync_ack(r, msg, now)
        if self.started_at is not None:
            # The CPU bridge's step_count is meaningless (0); the arrival is the ack.
            self.acked[r] = True

    def on_snapshot_ready(self, r: int, now: float) -> None:
        if self.started_at is not None:
            self.upload_ms[r] = (now - self.started_at) * 1000.0

    def schedule_eval(self, epoch: int, out: list[Out]) -> None:
        self.eval_due = epoch

    def _arm_eval(self, out: list[Out]) -> None:
        """Score the consensus of this very round (armed before RequestParams)."""
        roles = self.core.roles
        if self.eval_due is None and not roles.pending_eval_intent:
            return
        epoch = self.eval_due if self.eval_due is not None else self.core.dispatch.current_epoch()
        self.eval_due = None
        roles.pending_eval_intent = False
        target = roles.eval
        if self.core.alive(target):
            out.append(Send(target, ArmConsensusEval(epoch, epoch, target)))

    def trigger(self, now: float, closed: Ledger, armed: ArmedSave | None, out: list[Out]) -> None:
        core = self.core
        self._arm_eval(out)
        if core.dispatch.barrier_on_reduce:
            # Hard barrier: a rank training on while the reduce runs would have that work
            # overwritten by the Update. Throttle goes *before* RequestParams: the param
            # plane hands the rank its Update in process, which can overtake a Throttle
            # sent after the request (flodl's Update shared the control channel), and
            # an Update dispatched before its Throttle leaves the rank throttled with
            # nothing left to release it.
            out.append(Broadcast(Throttle()))
            self.throttled = Tracked([True] * core.ws)
        out.append(Broadcast(RequestParams()))
        self.started_at = now
        self.acked = Tracked([False] * core.ws)
        self.upload_ms = [None] * core.ws
        self._closing = closed
        self._armed = armed

    def poll(self, now: float, out: list[Out]) -> None:
        core = self.core
        if self.started_at is None:
            return
        if all(a or not core.alive(r) for r, a in enumerate(self.acked)):
            closed = self._closing or Ledger(core.ws)
            reduce_ms = (now - self.started_at) * 1000.0
            self.started_at = None
            self._closing = None
            self.close_window(closed, reduce_ms, out)
            plans: dict[int, EpochPlan] = core.dispatch.plans_for_update(now, out)
            for r in range(core.ws):
                if core.alive(r):
                    out.append(Send(r, WireUpdate(core.version, plans.get(r))))
            out.append(Broadcast(SetGlobalStep(core.global_step)))
            armed, self._armed = self._armed, None
            core.checkpoints.finish(armed, out)
            self.after_window(now, out)
        elif now - self.started_at > core.config.stall_ceiling:
            out.append(Alert("critical", "reduce_stall", "cpu reduce never completed"))
            self.started_at = None
            core.shutdown_with_save(SaveReason.REDUCE_STALL, out)

    def check_throttle(self, out: list[Out]) -> None:
        """Hold a rank too far ahead of the slowest working one (§4.8)."""
        core = self.core
        d = core.config.max_batch_diff
        if d is None or core.live.active_count < core.ws or not core.training:
            return
        steps = core.ledger.steps
        # The laggard is the slowest rank that still has work; an idle rank (its share
        # done) is not behind, and holding peers to its pace would freeze the epoch.
        working = [steps[r] for r in range(core.ws) if core.dispatch.has_in_flight(r)]
        if not working:
            return
        m = min(working)
        sync = core.policy is Policy.SYNC
        for r in range(core.ws):
            need = 1 if sync else core.elche.counts[r]
            # Only a rank that already met its own window may be held: holding one that
            # still owes steps would keep the gate shut with nobody able to open it.
            if steps[r] > m + d and steps[r] >= need and not self.throttled[r]:
                out.append(Send(r, Throttle()))
                self.throttled[r] = True
