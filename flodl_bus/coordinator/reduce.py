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

import math
from typing import TYPE_CHECKING

from flodl_bus.coordinator.checkpoint import ArmedSave
from flodl_bus.coordinator.config import Policy
from flodl_bus.coordinator.effects import Alert, Broadcast, Out, Send
from flodl_bus.coordinator.elche import WindowReport
from flodl_bus.coordinator.guard import VerdictKind, merge
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

if TYPE_CHECKING:
    from flodl_bus.coordinator.core import Coordinator

OVERSHOOT_START = 3
OVERSHOOT_CEILING = 15
#: callback slack is staged only when it is at least this share of a window, and 100 ms
SLACK_SHARE = 0.05
SLACK_FLOOR_MS = 100.0


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
        self.steps = [0] * world_size
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


class Reduce:
    """What both backends share: the per-rank reports of a round and closing a window."""

    #: fewest live ranks the backend can go on with (a cpu "group" of one averages alone)
    min_survivors = 1
    #: the final eval scores the consensus (cpu) rather than the live model (nccl)
    adopts_consensus = False

    def __init__(self, core: Coordinator) -> None:
        self.core = core
        ws = core.ws
        self.last_step_count = [0] * ws
        self.divergence: list[float | None] = [None] * ws
        self.pre_norm: list[float | None] = [None] * ws
        self.post_norm: float | None = None
        self.upload_ms: list[float | None] = [None] * ws
        self.throttled = [False] * ws

    # ------------------------------------------------------------- the backend's rules
    @property
    def in_flight(self) -> bool:
        """A cycle is open and the gate stays shut until it closes."""
        return False

    def blocks(self, r: int) -> bool:
        """Rank ``r`` holds the gate for this backend's own reason."""
        return False

    def settled(self) -> bool:
        """No rank is inside a collective (Shutdown may go out)."""
        return True

    def acks(self) -> list[bool]:
        raise NotImplementedError

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

    # ------------------------------------------------------------- closing a window
    def window_report(self, closed: Ledger, reduce_ms: float) -> WindowReport:
        core = self.core
        movers = [r for r in range(core.ws) if core.alive(r) and closed.steps[r] > 0]
        # All-or-none: mixing delivered and compute scales inverts allocations (§6 #15).
        coherent = self.measures_delivered() and all(
            closed.delivered_batches[r] > 0 for r in movers
        )
        ms: list[float | None] = [None] * core.ws
        fill = 0.0
        for r in movers:
            if coherent:
                marginal = closed.delivered_ms[r] / closed.delivered_batches[r]
                ms[r] = marginal
                first = closed.first_batch_ms[r]
                if first is not None:
                    fill = max(fill, first - marginal)
            else:
                ms[r] = closed.wall_ms[r] / closed.steps[r]
        return WindowReport(tuple(ms), reduce_ms=reduce_ms, fill_ms=fill)

    def close_window(self, closed: Ledger, reduce_ms: float) -> None:
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
        core.elche.apply_verdict(verdict)
        if core.overshoot_auto:
            if verdict.kind is VerdictKind.STABLE:
                core.max_overshoot = min(core.max_overshoot + 1, OVERSHOOT_CEILING)
            elif verdict.kind is VerdictKind.NUDGE_DOWN:
                core.max_overshoot = OVERSHOOT_START
        core.global_step += sum(closed.steps)

    def _stage_slack(self) -> None:
        """The epoch's last window: its callback rank's window is shortened by the
        callback's expected time, if that time is worth it (§4.13.4)."""
        core = self.core
        elche = core.elche
        if not core.config.callback_slack or not elche.calibrated:
            return
        remaining = core.dispatch.epoch_remaining()
        if remaining is None or remaining == 0 or remaining > sum(elche.counts):
            return
        rank = core.roles.epoch_callback
        slack = core.roles.ewma_ms["epoch_fn"]
        if slack is None or not core.alive(rank):
            return
        slow = elche.smoothed_ms(elche.anchor_rank) if elche.anchor_rank is not None else None
        anchor_wall_ms = elche.anchor * slow if slow is not None else 0.0
        if slack >= max(SLACK_SHARE * anchor_wall_ms, SLACK_FLOOR_MS):
            elche.stage_slack(rank, slack)

    def after_window(self, now: float, out: list[Out]) -> None:
        self.throttled = [False] * self.core.ws
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

    def __init__(self, core: Coordinator, *, adopts_consensus: bool) -> None:
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
        self.close_window(closed, 0.0)
        self.core.checkpoints.finish(armed, out)
        self.after_window(now, out)


class NcclReduce(Reduce):
    """The NCCL ack protocol (§4.4, §4.6.1)."""

    min_survivors = 2

    def __init__(self, core: Coordinator) -> None:
        super().__init__(core)
        ws = core.ws
        #: each rank's step when SyncNow went out; a later step is its ack
        self.sync_step = [0] * ws
        self.acked = [True] * ws
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

    def settled(self) -> bool:
        return self.unacked == 0

    def acks(self) -> list[bool]:
        return list(self.acked)

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

    def trigger(self, now: float, closed: Ledger, armed: ArmedSave | None, out: list[Out]) -> None:
        core = self.core
        self.sync_step = list(self.last_step_count)
        self.acked = [not a for a in core.alive_mask()]
        self.unacked = core.live.active_count
        self.armed = True
        self.started_at = now
        out.append(Broadcast(SyncNow()))
        # Ranks block in the collective: nothing else can move before they return, so
        # the cycle finishes in the same call (§4.6.1).
        self.close_window(closed, self.last_sync_ms)
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

    def __init__(self, core: Coordinator) -> None:
        super().__init__(core)
        self.started_at: float | None = None
        self.acked = [False] * core.ws
        #: the window the open cycle closes, and the save armed with it
        self._closing: Ledger | None = None
        self._armed: ArmedSave | None = None
        #: epoch whose eval waits for the next round's consensus
        self.eval_due: int | None = None

    @property
    def in_flight(self) -> bool:
        return self.started_at is not None

    def acks(self) -> list[bool]:
        return list(self.acked)

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
            self.throttled = [True] * core.ws
        out.append(Broadcast(RequestParams()))
        self.started_at = now
        self.acked = [False] * core.ws
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
            self.close_window(closed, reduce_ms)
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
