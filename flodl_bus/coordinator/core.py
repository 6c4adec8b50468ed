"""The coordinator's scheduling core, sans-IO (reference §4).

``Coordinator`` takes decoded upstream messages and the current time and returns what to
send (``effects``). It never reads a clock, never sleeps, never touches a socket or a
tensor, and iterates ranks in index order, so a recorded run replays exactly.

The runtime loop is::

    outs = core.start(now)
    while not core.finished:
        for delivery in bus.read_upstream(...):
            outs += core.handle(rank_of(delivery), delivery.msg, now)
        outs += core.tick(now)

Per-rank ordering is part of the contract: effects are returned in the order they must
reach each rank (``Send`` and ``Broadcast`` interleaved), e.g. ``SetEpochCallbackRole``
before the first ``StartEpoch``, ``SyncNow`` before the wake-up ``StartEpoch``,
``ArmConsensusEval`` before ``RequestParams``, the final reduce before ``Shutdown``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flodl_bus.coordinator.checkpoint import SCHEMA, Resume, coverage_block, read_meta
from flodl_bus.coordinator.chunk_pool import (
    ChunkPool,
    Range,
    coalesce,
    equal_sizes,
    final_window_alloc,
    ratio_to_sizes,
    throughput_sizes,
)
from flodl_bus.coordinator.config import Backend, CoordinatorConfig, Policy
from flodl_bus.coordinator.effects import Alert, Broadcast, Finished, Out, Send, WriteMeta
from flodl_bus.coordinator.elche import ElChe, WindowReport
from flodl_bus.coordinator.guard import STABLE, TrendGuard, Verdict, VerdictKind
from flodl_bus.coordinator.liveness import Rendezvous
from flodl_bus.coordinator.metrics import EpochBuffer, aggregate
from flodl_bus.coordinator.roles import Roles
from flodl_bus.protocol import leaving
from flodl_bus.protocol.messages import (
    FINAL_EVAL_SCHEDULE,
    ArmConsensusEval,
    Batch,
    Checkpoint,
    CheckpointResult,
    CoordHeartbeat,
    DeclareDead,
    EpochAggregated,
    EpochFnElapsed,
    EpochPlan,
    EvalBroadcast,
    EvalResult,
    ExecuteEvalCallback,
    Exiting,
    ExtendPartition,
    Heartbeat,
    Intent,
    IntentKind,
    LrUpdate,
    MetricsMsg,
    NewNcclIdGenerated,
    NewNcclSession,
    RequestNewNcclId,
    RequestParams,
    SaveConsensusModel,
    SaveReason,
    SetEpochCallbackRole,
    SetGlobalStep,
    Shutdown,
    ShutdownWithSave,
    SnapshotReady,
    StartEpoch,
    SyncAck,
    SyncNow,
    Throttle,
    WireUpdate,
)

MIN_CHUNK = 4
OVERSHOOT_START = 3
OVERSHOOT_CEILING = 15

TRAINING = "training"
FINAL_EVAL = "final_eval"
SHUTDOWN = "shutdown"


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


@dataclass(slots=True)
class _FinalWindow:
    #: (ElChe counts generation, liveness generation) the split was built from
    key: tuple[int, int]
    slots: list[int]
    total: int


@dataclass(slots=True)
class _ArmedSave:
    coverage: dict[str, Any]
    epoch: int


class Coordinator:
    def __init__(self, config: CoordinatorConfig) -> None:
        cfg = config
        self.config = cfg
        self.ws = ws = cfg.world_size
        self.backend = cfg.backend
        self.policy = cfg.policy
        self.nccl = self.backend is Backend.NCCL
        self.progressive = cfg.is_progressive
        self.barrier_paced = cfg.barrier_paced
        self.bs = cfg.batch_size
        self.elche = ElChe(
            ws,
            anchor=cfg.initial_anchor,
            overhead_target=cfg.overhead_target,
            max_anchor=cfg.max_anchor,
            min_anchor=cfg.min_anchor,
            max_batch_diff=cfg.max_batch_diff,
            window_cap=cfg.epoch_batches(0),
            growth=self.policy is not Policy.SYNC,
        )
        self.guard = TrendGuard(cfg.guard_threshold, enabled=self.policy is not Policy.SYNC)
        self.roles = Roles(ws, cfg.epoch_callback_rank)
        self.metrics = EpochBuffer(ws)
        self.version = 0
        self.avg_count = 0
        self.global_step = 0
        self.ledger = Ledger(ws)
        # NCCL ack protocol (§4.4)
        self.last_step_count = [0] * ws
        self.nccl_sync_step = [0] * ws
        self.nccl_ack = [True] * ws
        #: live ranks whose ack is missing (a counter: a per-ack scan is O(ws) per ack)
        self._unacked = 0
        self.nccl_armed = False
        self.nccl_started_at = 0.0
        self.last_nccl_sync_ms = 0.0
        # CPU cycle (§4.6)
        self.cpu_started_at: float | None = None
        self.cpu_acked = [False] * ws
        self._closing: Ledger | None = None
        self.divergence: list[float | None] = [None] * ws
        self.pre_norm: list[float | None] = [None] * ws
        self.post_norm: float | None = None
        self.upload_ms: list[float | None] = [None] * ws
        self.last_lr: list[float | None] = [None] * ws
        self.throttled = [False] * ws
        # dispatch (§4.10)
        self.pools: dict[int, ChunkPool] = {}
        self.final_windows: dict[int, _FinalWindow] = {}
        self.rank_epoch = [0] * ws
        self.last_aggregated = -1
        self.start_epoch = 0
        self._resume_holes: dict[int, list[Range]] = {}
        self._hooked_epoch = -1
        # non-progressive dispatch: one plan in flight per rank, the rest queued
        self.np_epoch = -1
        self.np_inflight: list[list[Range]] = [[] for _ in range(ws)]
        self.np_queue: list[deque[Range]] = [deque() for _ in range(ws)]
        self.np_batches = [0] * ws
        self._np_started_at = 0.0
        # liveness (§4.15)
        self.last_heartbeat = [0.0] * ws
        self.exited = [False] * ws
        self.dead = [False] * ws
        self.active_count = ws
        self._alive = [True] * ws
        self._alive_gen = 0
        self._live_sum_key = (-1, -1)
        self._live_sum = 0
        self.rendezvous = Rendezvous()
        self._last_coord_hb = 0.0
        # lifecycle (§4.16)
        self.phase = TRAINING
        self.finished = False
        self.finish_reason: SaveReason | None = None
        #: the rank the final eval went to; if it dies, the run stops waiting for it
        self.final_eval_rank: int | None = None
        self.final_eval_done = False
        self.lost_sends = 0
        self._redispatch: list[int] = []
        # callbacks and checkpoints (§4.13, §4.14)
        self._eval_due: int | None = None
        self._save_due = False
        self._armed_save: _ArmedSave | None = None
        self._saved_at_version = -1
        self.max_overshoot = cfg.max_overshoot if cfg.max_overshoot is not None else OVERSHOOT_START
        self._overshoot_auto = cfg.max_overshoot is None and self.policy is Policy.ASYNC
        self.last_verdict: Verdict = STABLE
        self._started = False

    # ================================================================= construction
    @classmethod
    def from_meta(cls, config: CoordinatorConfig, meta: Mapping[str, Any]) -> Coordinator:
        """Resume: rebuild counters and pools so only the uncovered samples are trained."""
        res: Resume = read_meta(config, meta)
        core = cls(config)
        core.global_step = res.global_step
        core.avg_count = res.sync_round
        core.version = res.version
        if res.elche_state is not None and len(res.elche_state.get("counts", [])) == core.ws:
            core.elche.restore(res.elche_state)
        core.guard.restore(res.trend_history)
        core.start_epoch = res.start_epoch
        core.last_aggregated = res.start_epoch - 1
        core.rank_epoch = [res.start_epoch] * core.ws
        core._resume_holes = dict(res.holes)
        # The resumed first epoch is not an epoch *transition*: no eval/checkpoint hook.
        core._hooked_epoch = res.start_epoch - 1 if res.start_epoch == 0 else res.start_epoch
        return core

    # ================================================================= public surface
    def alive(self, r: int) -> bool:
        return self._alive[r]

    def alive_mask(self) -> list[bool]:
        return list(self._alive)

    def _mark_gone(self, r: int) -> None:
        self._alive[r] = False
        self._alive_gen += 1

    def _live_counts_sum(self) -> int:
        key = (self.elche.generation, self._alive_gen)
        if key != self._live_sum_key:
            self._live_sum = sum(c for c, a in zip(self.elche.counts, self._alive) if a)
            self._live_sum_key = key
        return self._live_sum

    def start(self, now: float) -> list[Out]:
        """First dispatch: roles, then epoch ``start_epoch``'s plans or chunks."""
        out: list[Out] = []
        self._started = True
        self.last_heartbeat = [now] * self.ws
        self._last_coord_hb = now
        if self.global_step:
            out.append(Broadcast(SetGlobalStep(self.global_step)))
        if self.start_epoch < self.config.num_epochs:
            if self.progressive:
                for r in range(self.ws):
                    self._dispatch_next_chunk(r, now, out)
            else:
                self._np_dispatch_epoch(self.start_epoch, now, out)
        self._aggregate_ready(now, out)
        self._advance(now, out, aggregated=True)
        return out

    def handle(self, rank: int, msg: object, now: float) -> list[Out]:
        """Apply one upstream message from ``rank``'s stream."""
        out: list[Out] = []
        if not 0 <= rank < self.ws:
            out.append(Alert("warn", "unknown_rank", f"message from rank {rank}"))
            return out
        # Any frame is proof of life (§2.3).
        self.last_heartbeat[rank] = now
        if self.dead[rank]:
            # No resurrection: the rank's work was already handed to survivors.
            return out
        if isinstance(msg, Batch):
            self._on_batch(rank, msg, now)
        elif isinstance(msg, Heartbeat):
            pass
        elif isinstance(msg, LrUpdate):
            self.last_lr[rank] = msg.lr
        elif isinstance(msg, MetricsMsg):
            self._on_metrics(rank, msg, now, out)
        elif isinstance(msg, SyncAck):
            self._on_sync_ack(rank, msg, now)
        elif isinstance(msg, Exiting):
            if msg.reason is not None and self.phase != SHUTDOWN and self.alive(rank):
                self._on_leaving(rank, msg.reason, now, out)
            else:
                self._on_exiting(rank, out)
        elif isinstance(msg, Intent):
            if msg.kind is IntentKind.EVAL_NOW:
                self.roles.pending_eval_intent = True
            else:
                self.roles.pending_checkpoint_intent = True
        elif isinstance(msg, SnapshotReady):
            if self.cpu_started_at is not None:
                self.upload_ms[rank] = (now - self.cpu_started_at) * 1000.0
        elif isinstance(msg, EvalResult):
            self._on_eval_result(rank, msg, out)
        elif isinstance(msg, CheckpointResult):
            self._on_checkpoint_result(rank, msg, out)
        elif isinstance(msg, EpochFnElapsed):
            self.ledger.exclude(rank, msg.elapsed_ms)
            self.roles.observe("epoch_fn", msg.elapsed_ms)
        elif isinstance(msg, NewNcclIdGenerated):
            self._on_nccl_id(rank, msg, out)
        else:
            out.append(Alert("warn", "unexpected_upstream", type(msg).__name__))
        return out

    def tick(self, now: float) -> list[Out]:
        """Periodic work in the reference's order (§4.2)."""
        out: list[Out] = []
        if self.finished or not self._started:
            return out
        if now - self._last_coord_hb >= self.config.coord_heartbeat_every:
            self._last_coord_hb = now
            out.append(Broadcast(CoordHeartbeat()))
        if self.config.elastic:
            self._check_dead_ranks(now, out)
        if self.finished:
            return out
        self._check_rendezvous_timeout(now, out)
        if self.finished:
            return out
        if self._redispatch and self.phase == TRAINING:
            retry, self._redispatch = self._redispatch, []
            for r in retry:
                if not self._has_in_flight(r):
                    self._dispatch_next_chunk(r, now, out)
        self._check_throttle(out)
        self._poll_cpu(now, out)
        self._poll_nccl_stall(now, out)
        if self.finished:
            return out
        if self.should_average():
            self._trigger(now, out)
        aggregated = self._aggregate_ready(now, out)
        self._advance(now, out, aggregated)
        return out

    def send_failed(self, rank: int, msg: object, now: float) -> list[Out]:
        """The runtime could not deliver ``msg``: roll back a chunk it carried (§6 #18)."""
        out: list[Out] = []
        self.lost_sends += 1
        plan = None
        if isinstance(msg, StartEpoch):
            plan = msg.plan
        elif isinstance(msg, WireUpdate):
            plan = msg.next_plan
        if plan is not None:
            if self.progressive:
                pool = self.pools.get(plan.epoch)
                if pool is not None and pool.rollback_take(
                    rank, plan.partition_offset, plan.partition_size
                ):
                    fw = self.final_windows.get(plan.epoch)
                    if fw is not None:
                        fw.slots[rank] += plan.partition_size // self.bs
                        fw.total += plan.partition_size // self.bs
                    # Re-offered on the next tick (not here: a dead link would spin).
                    if rank not in self._redispatch:
                        self._redispatch.append(rank)
            elif plan.epoch == self.np_epoch:
                rng = (plan.partition_offset, plan.partition_size)
                if rng in self.np_inflight[rank]:
                    self.np_inflight[rank].remove(rng)
                    self.np_queue[rank].appendleft(rng)
        if self.phase != SHUTDOWN:
            out.append(Alert("warn", "control_drop", f"{type(msg).__name__} to rank {rank}"))
        return out

    # ----------------------------------------------------------------- the gate (§4.5)
    def gate(self) -> tuple[bool, str]:
        """Whether a reduce may fire now, and if not, why (for the recorder)."""
        if self.phase == SHUTDOWN:
            return False, "shutdown"
        if not self.nccl and self.cpu_started_at is not None:
            return False, "cpu cycle in flight"
        if self.active_count == 0:
            return False, "no active rank"
        any_mover = False
        sync = self.policy is Policy.SYNC
        counts = self.elche.counts
        steps = self.ledger.steps
        for r in range(self.ws):
            if self.dead[r] or self.exited[r]:
                continue
            if self.nccl and not self.nccl_ack[r]:
                return False, f"rank {r} has not acked the last SyncNow"
            s = steps[r]
            if s > 0:
                any_mover = True
            need = 1 if sync else counts[r]
            if s >= need:
                continue
            if self._quiesced(r):
                continue
            return False, f"rank {r} at {s}/{need} steps"
        if not any_mover:
            return False, "no rank moved"
        return True, "open"

    def should_average(self) -> bool:
        return self.gate()[0]

    # ----------------------------------------------------------------- summary
    def state_summary(self) -> dict[str, Any]:
        open_, why = self.gate()
        return {
            "phase": self.phase,
            "version": self.version,
            "global_step": self.global_step,
            "avg_count": self.avg_count,
            "steps": list(self.ledger.steps),
            "last_step_count": list(self.last_step_count),
            "acks": list(self.nccl_ack) if self.nccl else list(self.cpu_acked),
            "cpu_pending": self.cpu_started_at is not None,
            "rank_epoch": list(self.rank_epoch) if self.progressive else [self.np_epoch] * self.ws,
            "in_flight": [self._in_flight(r) for r in range(self.ws)],
            "dead": [r for r in range(self.ws) if self.dead[r]],
            "exited": [r for r in range(self.ws) if self.exited[r]],
            "throttled": [r for r in range(self.ws) if self.throttled[r]],
            "anchor": self.elche.anchor,
            "counts": list(self.elche.counts),
            "last_aggregated": self.last_aggregated,
            "pools": {e: p.remaining() for e, p in sorted(self.pools.items())},
            "gate": {"open": open_, "why": why},
        }

    # ================================================================= upstream
    def _on_batch(self, r: int, msg: Batch, now: float) -> None:
        self.ledger.record_batch(r, msg.batch_ms, msg.data_ms, msg.batch_loss)
        if msg.step_count > self.last_step_count[r]:
            self.last_step_count[r] = msg.step_count
        if not self.progressive:
            self.np_batches[r] += 1
        if self.nccl and not self.nccl_ack[r] and msg.step_count > self.nccl_sync_step[r]:
            self._ack(r, now)

    def _on_sync_ack(self, r: int, msg: SyncAck, now: float) -> None:
        # Never a step: counting it would advance global_step (and the LR) early.
        self.divergence[r] = msg.divergence
        self.pre_norm[r] = msg.pre_norm
        if self.post_norm is None:
            self.post_norm = msg.post_norm
        if self.nccl:
            if msg.step_count > self.last_step_count[r]:
                self.last_step_count[r] = msg.step_count
            if not self.nccl_ack[r] and msg.step_count > self.nccl_sync_step[r]:
                self._ack(r, now)
        elif self.cpu_started_at is not None:
            # The CPU bridge's step_count is meaningless (0); the arrival is the ack.
            self.cpu_acked[r] = True

    def _ack(self, r: int, now: float) -> None:
        self._settle(r)
        if self.nccl_armed and self._all_acked():
            self.nccl_armed = False
            self.last_nccl_sync_ms = (now - self.nccl_started_at) * 1000.0

    def _settle(self, r: int) -> None:
        """Count ``r`` as acked (it acked, died or exited)."""
        if not self.nccl_ack[r]:
            self.nccl_ack[r] = True
            self._unacked -= 1

    def _all_acked(self) -> bool:
        return self._unacked == 0

    def _on_exiting(self, r: int, out: list[Out]) -> None:
        if self.exited[r]:
            return
        self.exited[r] = True
        self._mark_gone(r)
        self.active_count = max(self.active_count - 1, 0)
        if self.nccl and self.nccl_armed and not self.nccl_ack[r]:
            # A rank that left mid-reduce strands its peers in the collective.
            out.append(Broadcast(DeclareDead(r)))
        self._settle(r)
        if self.nccl_armed and self._all_acked():
            self.nccl_armed = False

    def _on_leaving(self, r: int, reason: str, now: float, out: list[Out]) -> None:
        """A rank leaving mid-run said why (``protocol.leaving``)."""
        if leaving.kind_of(reason) == leaving.JOB_FAILED:
            # The job's code is the same on every rank: what failed here fails there
            # too, so the run stops (with its save) instead of re-forming around it.
            out.append(Alert("critical", "job_failed", f"rank {r}: {leaving.detail_of(reason)}"))
            self._on_exiting(r, out)
            self._shutdown_with_save(SaveReason.JOB_FAILED, out)
            return
        # Anything else (a signal, its averaging failed for good, its runtime broke): a
        # death it announced, handled now instead of after the heartbeat timeout.
        out.append(Alert("warning", "rank_leaving", f"rank {r}: {reason}"))
        self._process_death(r, now, out)
        self._after_deaths(now, out)

    def _on_eval_result(self, r: int, msg: EvalResult, out: list[Out]) -> None:
        self.ledger.exclude(r, msg.elapsed_ms)
        self.roles.observe("eval", msg.elapsed_ms)
        if msg.schedule_id == FINAL_EVAL_SCHEDULE:
            self.final_eval_done = True
        if msg.error is not None:
            out.append(Alert("warn", "eval_failed", f"rank {r}: {msg.error}"))
            return
        out.append(Broadcast(EvalBroadcast(msg.epoch, msg.metric)))

    def _on_checkpoint_result(self, r: int, msg: CheckpointResult, out: list[Out]) -> None:
        self.ledger.exclude(r, msg.elapsed_ms)
        if msg.error is None:
            self.roles.observe("checkpoint", msg.elapsed_ms)
            self.roles.checkpoint_succeeded(r)
            return
        nxt = self.roles.checkpoint_failed(r, self.alive_mask())
        if nxt is None:
            out.append(Alert("warn", "checkpoint_gave_up", f"version {msg.version}"))
        else:
            out.append(Send(nxt, Checkpoint(msg.version, nxt)))

    def _on_metrics(self, r: int, msg: MetricsMsg, now: float, out: list[Out]) -> None:
        self.metrics.record(r, msg)
        if self.progressive:
            pool = self.pools.get(msg.epoch)
            if pool is not None:
                pool.mark_completed(r, msg.samples_processed)
            if self.phase == TRAINING:
                self._dispatch_next_chunk(r, now, out)
            return
        if msg.epoch != self.np_epoch or not self.np_inflight[r]:
            return
        # Whatever of the plan (and its extensions) the rank did not train goes back in
        # front of its queue: an ExtendPartition that raced the plan's end is not lost.
        trained = msg.samples_processed
        leftover: list[Range] = []
        for off, size in self.np_inflight[r]:
            done = min(trained, size)
            trained -= done
            if done < size:
                leftover.append((off + done, size - done))
        self.np_inflight[r] = []
        self.np_batches[r] = 0
        for rng in reversed(leftover):
            self.np_queue[r].appendleft(rng)
        if self.phase == TRAINING:
            self._np_send_next(r, out)

    def _on_nccl_id(self, r: int, msg: NewNcclIdGenerated, out: list[Out]) -> None:
        if self.rendezvous.generator != r:
            out.append(Alert("warn", "stray_nccl_id", f"from rank {r}"))
            return
        survivors = [s for s in range(self.ws) if self.alive(s)]
        self.rendezvous.reset()
        # A cpu world of one still trains (its "group" of one averages with itself).
        if len(survivors) < (2 if self.nccl else 1):
            self._shutdown_with_save(SaveReason.SINGLE_SURVIVOR, out)
            return
        for i, s in enumerate(survivors):
            out.append(Send(s, NewNcclSession(msg.uid_bytes, i, len(survivors))))

    # ================================================================= reduce (§4.6)
    def _trigger(self, now: float, out: list[Out]) -> None:
        closed = self.ledger
        self.ledger = Ledger(self.ws)
        armed = self._maybe_arm_save()
        if self.nccl:
            self.nccl_sync_step = list(self.last_step_count)
            self.nccl_ack = [not a for a in self._alive]
            self._unacked = self.active_count
            self.nccl_armed = True
            self.nccl_started_at = now
            out.append(Broadcast(SyncNow()))
            # Ranks block in the collective: nothing else can move before they return,
            # so the cycle finishes in the same call (§4.6.1).
            self._finish_head(closed, self.last_nccl_sync_ms)
            out.append(Broadcast(SetGlobalStep(self.global_step)))
            self._finish_save(armed, out)
            self._common_tail(now, out)
            return
        self._maybe_arm_eval(out)
        if not self.progressive:
            # Hard barrier: a rank training on while the reduce runs would have that work
            # overwritten by the Update. Throttle goes *before* RequestParams: the param
            # plane hands the rank its Update in process, which can overtake a Throttle
            # sent after the request (flodl's Update shared the control channel), and
            # an Update dispatched before its Throttle leaves the rank throttled with
            # nothing left to release it.
            out.append(Broadcast(Throttle()))
            self.throttled = [True] * self.ws
        out.append(Broadcast(RequestParams()))
        self.cpu_started_at = now
        self.cpu_acked = [False] * self.ws
        self.upload_ms = [None] * self.ws
        self._closing = closed
        self._armed_save = armed

    def _poll_cpu(self, now: float, out: list[Out]) -> None:
        if self.nccl or self.cpu_started_at is None:
            return
        if all(a or not self.alive(r) for r, a in enumerate(self.cpu_acked)):
            closed = self._closing or Ledger(self.ws)
            reduce_ms = (now - self.cpu_started_at) * 1000.0
            self.cpu_started_at = None
            self._closing = None
            self._finish_head(closed, reduce_ms)
            plans: dict[int, EpochPlan] = {}
            if self.progressive and self.policy is Policy.CADENCE:
                # Atomic dispatch: the next chunk rides the Update, so a rank never idles
                # between adopting the consensus and receiving work.
                for r in range(self.ws):
                    plan = self._dispatch_next_chunk(r, now, out, via_update=True)
                    if plan is not None:
                        plans[r] = plan
            for r in range(self.ws):
                if self.alive(r):
                    out.append(Send(r, WireUpdate(self.version, plans.get(r))))
            out.append(Broadcast(SetGlobalStep(self.global_step)))
            armed, self._armed_save = self._armed_save, None
            self._finish_save(armed, out)
            self._common_tail(now, out)
        elif now - self.cpu_started_at > self.config.stall_ceiling:
            out.append(Alert("critical", "reduce_stall", "cpu reduce never completed"))
            self.cpu_started_at = None
            self._shutdown_with_save(SaveReason.REDUCE_STALL, out)

    def _poll_nccl_stall(self, now: float, out: list[Out]) -> None:
        if not self.nccl or not self.nccl_armed or self._all_acked():
            return
        if now - self.nccl_started_at > self.config.stall_ceiling:
            out.append(Alert("critical", "reduce_stall", "SyncNow never acked"))
            self.nccl_armed = False
            self._shutdown_with_save(SaveReason.REDUCE_STALL, out)

    def _window_report(self, closed: Ledger, reduce_ms: float) -> WindowReport:
        movers = [r for r in range(self.ws) if self.alive(r) and closed.steps[r] > 0]
        capable = self.policy is not Policy.SYNC and (
            not self.nccl or self.policy is Policy.CADENCE
        )
        # All-or-none: mixing delivered and compute scales inverts allocations (§6 #15).
        coherent = capable and all(closed.delivered_batches[r] > 0 for r in movers)
        ms: list[float | None] = [None] * self.ws
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

    def _finish_head(self, closed: Ledger, reduce_ms: float) -> None:
        was_calibrated = self.elche.calibrated
        self.elche.report_window(self._window_report(closed, reduce_ms))
        if not was_calibrated and self.elche.calibrated:
            alive = self.alive_mask()
            self.roles.elect_fastest(self.elche.fastest(alive), alive)
        verdict = self.guard.report(
            [self.divergence[r] if self.alive(r) else None for r in range(self.ws)]
        )
        self.last_verdict = verdict
        self.version += 1
        self.avg_count += 1
        self.elche.apply_verdict(verdict)
        if self._overshoot_auto:
            if verdict.kind is VerdictKind.STABLE:
                self.max_overshoot = min(self.max_overshoot + 1, OVERSHOOT_CEILING)
            elif verdict.kind is VerdictKind.NUDGE_DOWN:
                self.max_overshoot = OVERSHOOT_START
        self.global_step += sum(closed.steps)

    def _common_tail(self, now: float, out: list[Out]) -> None:
        self.throttled = [False] * self.ws
        self.divergence = [None] * self.ws
        self.pre_norm = [None] * self.ws
        self.post_norm = None
        if self.progressive and self.phase == TRAINING:
            # A rank parked in wait_for_epoch_plan sends nothing, so nothing else would
            # ever dispatch to it; its StartEpoch queues behind the reduce's messages.
            for r in range(self.ws):
                if not self._has_in_flight(r):
                    self._dispatch_next_chunk(r, now, out)

    # ----------------------------------------------------------------- throttle (§4.8)
    def _check_throttle(self, out: list[Out]) -> None:
        d = self.config.max_batch_diff
        if self.nccl or d is None or self.active_count < self.ws or self.phase != TRAINING:
            return
        steps = self.ledger.steps
        # The laggard is the slowest rank that still has work; an idle rank (its share
        # done) is not behind, and holding peers to its pace would freeze the epoch.
        working = [steps[r] for r in range(self.ws) if self._has_in_flight(r)]
        if not working:
            return
        m = min(working)
        sync = self.policy is Policy.SYNC
        for r in range(self.ws):
            need = 1 if sync else self.elche.counts[r]
            # Only a rank that already met its own window may be held: holding one that
            # still owes steps would keep the gate shut with nobody able to open it.
            if steps[r] > m + d and steps[r] >= need and not self.throttled[r]:
                out.append(Send(r, Throttle()))
                self.throttled[r] = True

    # ================================================================= dispatch (§4.10)
    def _has_in_flight(self, r: int) -> bool:
        if not self.progressive:
            return bool(self.np_inflight[r])
        return any(p.has_in_flight(r) for p in self.pools.values())

    def _in_flight(self, r: int) -> int:
        if not self.progressive:
            return sum(s for _, s in self.np_inflight[r])
        return sum(p.in_flight(r) for p in self.pools.values())

    def _quiesced(self, r: int) -> bool:
        """Nothing in flight and nothing this rank could be given in its epoch (§4.5).

        Non-progressive too (flodl applies it to pools only): a rank that finished its
        epoch share would otherwise hold the gate, and any Throttle, until the epoch ends.
        """
        if self._has_in_flight(r):
            return False
        if not self.progressive:
            return not self.np_queue[r]
        pool = self.pools.get(self.rank_epoch[r])
        if pool is None or pool.remaining() == 0:
            return True
        fw = self.final_windows.get(pool.epoch)
        return fw is not None and fw.slots[r] == 0

    def _budget(self, r: int) -> int:
        extra = self.max_overshoot if self.policy is Policy.ASYNC else 0
        return self.elche.counts[r] + extra

    def _pool_weights(self) -> list[float]:
        alive = self.alive_mask()
        if self.elche.calibrated:
            return [float(c) if a else 0.0 for c, a in zip(self.elche.counts, alive)]
        return [1.0 if a else 0.0 for a in alive]

    def _get_pool(self, epoch: int, now: float, out: list[Out]) -> ChunkPool:
        pool = self.pools.get(epoch)
        if pool is None:
            self._epoch_hooks(epoch, out)
            holes = self._resume_holes.pop(epoch, None)
            if holes is not None:
                pool = ChunkPool.from_coverage(epoch, holes, self.ws, now)
            else:
                pool = ChunkPool.create(
                    epoch,
                    self.config.epoch_batches(epoch),
                    self.bs,
                    self._pool_weights(),
                    now,
                )
            self.pools[epoch] = pool
        return pool

    def _dispatch_next_chunk(
        self, r: int, now: float, out: list[Out], via_update: bool = False
    ) -> EpochPlan | None:
        if not self.alive(r) or self.phase != TRAINING:
            return None
        # One chunk in flight per rank: the rank has a single pending-plan slot, and a
        # second plan would overwrite an unconsumed one and wedge the epoch (§6 #1).
        if self._has_in_flight(r):
            return None
        budget = self._budget(r)
        if self.ledger.steps[r] >= budget:
            return None
        epoch = self.rank_epoch[r]
        pool = self.pools.get(epoch)
        if pool is None and epoch > self.last_aggregated and epoch < self.config.num_epochs:
            pool = self._get_pool(epoch, now, out)
        if pool is None or pool.remaining() == 0:
            nxt = max(epoch + 1, self.last_aggregated + 1)
            if nxt >= self.config.num_epochs:
                return None
            live_older = any(e < nxt for e in self.pools)
            # Epoch barrier: a barrier-paced rank never streams into the next epoch while
            # an older one is still in flight (§6 #17).
            if self.barrier_paced and live_older:
                return None
            if nxt > self.last_aggregated + 2:
                return None
            pool = self._get_pool(nxt, now, out)
            self.rank_epoch[r] = nxt
            epoch = nxt
            if pool.remaining() == 0:
                return None
        batches = self._chunk_batches(r, pool, budget)
        if batches <= 0:
            return None
        got = pool.take_chunk(batches * self.bs, r)
        if got is None:
            return None
        fw = self.final_windows.get(epoch)
        if fw is not None:
            used = min(fw.slots[r], got[1] // self.bs)
            fw.slots[r] -= used
            fw.total -= used
        plan = EpochPlan(epoch, got[0], got[1])
        if not via_update:
            out.append(Send(r, StartEpoch(plan)))
        return plan

    def _chunk_batches(self, r: int, pool: ChunkPool, budget: int) -> int:
        remaining = pool.remaining() // self.bs
        if remaining <= 0:
            return 0
        if self.barrier_paced:
            fw = self._refresh_final_window(pool, remaining)
            if fw is not None:
                return fw.slots[r]
        counts = self.elche.counts
        left = max(budget - self.ledger.steps[r], 1)
        live_sum = self._live_counts_sum()
        if remaining < live_sum or self.barrier_paced:
            return min(counts[r], remaining, left)
        if not self.elche.calibrated:
            probe = max(self.config.epoch_batches(pool.epoch) // (self.ws * 10), MIN_CHUNK)
            return min(probe, remaining, left)
        share = math.ceil(remaining * counts[r] / max(live_sum, 1))
        return min(max(share, MIN_CHUNK), remaining, left)

    def _refresh_final_window(self, pool: ChunkPool, remaining: int) -> _FinalWindow | None:
        key = (self.elche.generation, self._alive_gen)
        fw = self.final_windows.get(pool.epoch)
        # A pinned split stays valid while the counts and liveness it was built from
        # hold and its slots still sum to what is left; otherwise re-pin from the live
        # remainder (a stale pin can leave a zero-slot rank the gate waits for, §6 #34).
        if fw is not None and fw.key == key and fw.total == remaining:
            return fw
        if remaining < self._live_counts_sum() + self.active_count:
            slots = final_window_alloc(remaining, self.elche.counts, self._alive)
            fw = _FinalWindow(key, slots, remaining)
            self.final_windows[pool.epoch] = fw
            return fw
        self.final_windows.pop(pool.epoch, None)
        return None

    # ----------------------------------------------------------------- non-progressive
    def _partition_batches(self, total: int, alive: Sequence[bool]) -> list[int]:
        live = [r for r in range(self.ws) if alive[r]]
        ratios = self.config.partition_ratios
        if ratios is not None:
            sizes = ratio_to_sizes(total, [ratios[r] if alive[r] else 0.0 for r in range(self.ws)])
        elif self.policy is not Policy.SYNC and self.elche.calibrated:
            ms = [self.elche.smoothed_ms(r) for r in live]
            sub = throughput_sizes(total, ms)
            sizes = [0] * self.ws
            for r, s in zip(live, sub):
                sizes[r] = s
        else:
            sub = equal_sizes(total, len(live)) if live else []
            sizes = [0] * self.ws
            for r, s in zip(live, sub):
                sizes[r] = s
        return sizes

    def _np_dispatch_epoch(self, epoch: int, now: float, out: list[Out]) -> None:
        self._epoch_hooks(epoch, out)
        holes = self._resume_holes.pop(epoch, None)
        ranges = holes if holes is not None else [(0, self.config.epoch_batches(epoch) * self.bs)]
        total = sum(s for _, s in ranges) // self.bs
        alive = self.alive_mask()
        shares = split_ranges(ranges, [b * self.bs for b in self._partition_batches(total, alive)])
        self.np_epoch = epoch
        self._np_started_at = now
        for r in range(self.ws):
            self.np_inflight[r] = []
            self.np_queue[r] = deque(shares[r])
            self.np_batches[r] = 0
            if alive[r]:
                self._np_send_next(r, out)

    def _np_send_next(self, r: int, out: list[Out]) -> None:
        if self.np_inflight[r] or not self.np_queue[r]:
            return
        off, size = self.np_queue[r].popleft()
        self.np_inflight[r] = [(off, size)]
        self.np_batches[r] = 0
        out.append(Send(r, StartEpoch(EpochPlan(self.np_epoch, off, size))))

    # ----------------------------------------------------------------- epoch hooks
    def _epoch_hooks(self, epoch: int, out: list[Out]) -> None:
        """Once per epoch, before its first plan: role broadcast, callbacks (§4.10.7)."""
        if self.roles.dirty:
            out.append(Broadcast(SetEpochCallbackRole(self.roles.epoch_callback)))
            self.roles.dirty = False
        if epoch <= self._hooked_epoch:
            return
        self._hooked_epoch = epoch
        cfg = self.config
        if epoch == 0:
            return
        roles = self.roles
        if (cfg.checkpoint_every and epoch % cfg.checkpoint_every == 0) or (
            roles.pending_checkpoint_intent
        ):
            roles.pending_checkpoint_intent = False
            out.append(Send(roles.checkpoint, Checkpoint(epoch, roles.checkpoint)))
            if cfg.save_path is not None:
                self._save_due = True
        eval_due = bool(cfg.eval_every and epoch % cfg.eval_every == 0)
        if eval_due or roles.pending_eval_intent:
            if self.nccl:
                roles.pending_eval_intent = False
                out.append(Send(roles.eval, ExecuteEvalCallback(epoch, epoch, roles.eval)))
            else:
                self._eval_due = epoch

    def _maybe_arm_eval(self, out: list[Out]) -> None:
        """CPU: score the consensus of this very round (armed before RequestParams)."""
        if self._eval_due is None and not self.roles.pending_eval_intent:
            return
        epoch = self._eval_due if self._eval_due is not None else self._current_epoch()
        self._eval_due = None
        self.roles.pending_eval_intent = False
        target = self.roles.eval
        if self.alive(target):
            out.append(Send(target, ArmConsensusEval(epoch, epoch, target)))

    def _current_epoch(self) -> int:
        if self.progressive:
            return max(self.rank_epoch)
        return max(self.np_epoch, 0)

    # ----------------------------------------------------------------- aggregation (§4.11)
    def _aggregate_ready(self, now: float, out: list[Out]) -> bool:
        done_any = False
        if self.progressive:
            for e in sorted(self.pools):
                pool = self.pools[e]
                if e != self.last_aggregated + 1 or not pool.is_epoch_done():
                    break
                epoch_ms = (now - pool.created_at) * 1000.0
                del self.pools[e]
                self.final_windows.pop(e, None)
                self._publish_epoch(e, epoch_ms, out)
                done_any = True
            return done_any
        busy = any(self.np_inflight[r] or self.np_queue[r] for r in range(self.ws) if self.alive(r))
        if self.np_epoch == self.last_aggregated + 1 and self.np_epoch >= 0 and not busy:
            self._publish_epoch(self.np_epoch, None, out)
            done_any = True
        return done_any

    def _publish_epoch(self, epoch: int, epoch_ms: float | None, out: list[Out]) -> None:
        accs = self.metrics.pop(epoch)
        em = aggregate(epoch, accs, self.elche.recent_batch_share(), epoch_ms)
        self.last_aggregated = epoch
        out.append(Broadcast(EpochAggregated(em)))

    # ----------------------------------------------------------------- end of run (§4.16)
    def _advance(self, now: float, out: list[Out], aggregated: bool) -> None:
        if self.phase == SHUTDOWN or self.cpu_started_at is not None:
            return
        if self.last_aggregated >= self.config.num_epochs - 1:
            self._maybe_shutdown(now, out)
            return
        if self.progressive:
            if aggregated and self.phase == TRAINING:
                for r in range(self.ws):
                    if not self._has_in_flight(r):
                        self._dispatch_next_chunk(r, now, out)
        elif self.last_aggregated + 1 > self.np_epoch:
            self._np_dispatch_epoch(self.last_aggregated + 1, now, out)
        elif self.phase == TRAINING:
            # A plan whose send failed went back to its queue; resend it.
            for r in range(self.ws):
                if self.alive(r) and not self.np_inflight[r] and self.np_queue[r]:
                    self._np_send_next(r, out)

    def _maybe_shutdown(self, now: float, out: list[Out]) -> None:
        alive = [r for r in range(self.ws) if self.alive(r)]
        if self.phase == TRAINING:
            trailing = any(self.ledger.steps[r] > 0 for r in alive)
            if len(alive) >= 2 and trailing:
                # Final consensus reduce, while idle ranks still service control.
                if not self.nccl or self._all_acked():
                    self._save_due = self._save_due or self.config.save_path is not None
                    self._trigger(now, out)
                return
            if self.config.final_eval and self.alive(self.roles.eval):
                self.phase = FINAL_EVAL
                target = self.roles.eval
                self.final_eval_rank = target
                out.append(
                    Send(
                        target,
                        ExecuteEvalCallback(
                            FINAL_EVAL_SCHEDULE, self.config.num_epochs, target, not self.nccl
                        ),
                    )
                )
                return
        if (
            self.phase == FINAL_EVAL
            and not self.final_eval_done
            and self.final_eval_rank is not None
            and self.alive(self.final_eval_rank)
        ):
            # Waits on the rank that was asked: on its death the eval role moves to a
            # rank that never got the request, and waiting on the role would never end.
            return
        # NCCL settle gate: never Shutdown ranks still inside a collective (§6 #6).
        if self.nccl and not self._all_acked():
            return
        if self.config.save_path is not None and self._saved_at_version != self.version:
            target = self.roles.checkpoint
            out.append(WriteMeta(self._meta(SaveReason.GRACEFUL_SHUTDOWN, self._coverage())))
            if self.alive(target):
                out.append(Send(target, SaveConsensusModel(target)))
            self._saved_at_version = self.version
        self.phase = SHUTDOWN
        self.finished = True
        out.append(Broadcast(Shutdown()))
        out.append(Finished(None))

    def _shutdown_with_save(self, reason: SaveReason, out: list[Out]) -> None:
        if self.phase == SHUTDOWN:
            return
        out.append(WriteMeta(self._meta(reason, self._coverage())))
        out.append(Broadcast(ShutdownWithSave(reason)))
        self.phase = SHUTDOWN
        self.finished = True
        self.finish_reason = reason
        out.append(Finished(reason))

    # ----------------------------------------------------------------- checkpoints (§4.14)
    def _maybe_arm_save(self) -> _ArmedSave | None:
        if self.config.save_path is None or not self._save_due:
            return None
        self._save_due = False
        # Coverage is captured now, before any rank freezes for this reduce.
        return _ArmedSave(self._coverage(), self._current_epoch())

    def _finish_save(self, armed: _ArmedSave | None, out: list[Out]) -> None:
        if armed is None:
            return
        out.append(WriteMeta(self._meta(SaveReason.CHECKPOINT, armed.coverage)))
        target = self.roles.checkpoint
        if self.alive(target):
            out.append(Send(target, SaveConsensusModel(target)))
        self._saved_at_version = self.version

    def _coverage(self) -> dict[str, Any]:
        epochs: list[tuple[int, list[Range]]] = []
        if self.progressive:
            epochs = [(e, self.pools[e].uncovered_ranges()) for e in sorted(self.pools)]
            next_epoch = max(self.pools) + 1 if self.pools else self.last_aggregated + 1
        else:
            next_epoch = max(self.np_epoch + 1, self.last_aggregated + 1)
            if self.np_epoch > self.last_aggregated:
                holes: list[Range] = []
                for r in range(self.ws):
                    holes += self.np_inflight[r] + list(self.np_queue[r])
                epochs.append((self.np_epoch, holes))
        # A resumed epoch not yet re-opened keeps its holes in the next save.
        epochs += [(e, list(h)) for e, h in sorted(self._resume_holes.items())]
        epochs.sort()
        if self._resume_holes:
            next_epoch = max(next_epoch, max(self._resume_holes) + 1)
        return coverage_block(self.config, next_epoch, epochs)

    def _meta(self, reason: SaveReason, coverage: Mapping[str, Any]) -> dict[str, Any]:
        elche = self.elche.state()
        elche["trend_history"] = list(self.guard.history)
        return {
            "schema": SCHEMA,
            "epoch": self._current_epoch(),
            "global_step": self.global_step,
            "sync_round": self.avg_count,
            "version": self.version,
            "world_size": self.ws,
            "mode": self.config.mode,
            "reason": reason.snake,
            "elche_state": elche,
            "coverage": dict(coverage),
        }

    # ================================================================= liveness (§4.15)
    def _check_dead_ranks(self, now: float, out: list[Out]) -> None:
        timeout = self.config.heartbeat_timeout
        died = False
        for r in range(self.ws):
            if self.alive(r) and now - self.last_heartbeat[r] > timeout:
                self._process_death(r, now, out)
                died = True
        if not died or self.phase == SHUTDOWN:
            return
        self._after_deaths(now, out)

    def _after_deaths(self, now: float, out: list[Out]) -> None:
        """Stop with a save if the survivors cannot go on, else re-form their group."""
        reason = self._unrecoverable_reason()
        if reason is not None:
            self._shutdown_with_save(reason, out)
        else:
            self.rendezvous.reset()
            self._next_generator(now, out)

    def interrupt(self, now: float) -> list[Out]:
        """Stop from outside (Ctrl-C, SIGTERM): Shutdown now, and nothing is dispatched
        after it (metrics still arriving must not produce StartEpochs)."""
        if self.phase == SHUTDOWN:
            return []
        self.phase = SHUTDOWN
        self.finished = True
        return [Broadcast(Shutdown()), Finished(None)]

    def declare_dead(self, rank: int, now: float) -> list[Out]:
        """A death reported from outside the sweep (a child exit, a broken data link)."""
        out: list[Out] = []
        if not 0 <= rank < self.ws or not self.alive(rank) or self.phase == SHUTDOWN:
            return out
        self._process_death(rank, now, out)
        self._after_deaths(now, out)
        return out

    def _process_death(self, r: int, now: float, out: list[Out]) -> None:
        out.append(Alert("critical", "rank_lost", f"rank {r} silent or reported dead"))
        remainder: list[Range] = []
        if not self.progressive:
            done = self.np_batches[r] * self.bs
            for off, size in self.np_inflight[r]:
                skip = min(done, size)
                done -= skip
                if skip < size:
                    remainder.append((off + skip, size - skip))
            remainder += list(self.np_queue[r])
            self.np_inflight[r] = []
            self.np_queue[r].clear()
        self.dead[r] = True
        self._mark_gone(r)
        self.active_count = max(self.active_count - 1, 0)
        self.throttled[r] = False
        alive = self.alive_mask()
        self.elche.forget(r)
        self.roles.on_death(r, alive, self.elche.fastest(alive))
        self._settle(r)
        # Both backends average through one collective group of the ranks (the cpu
        # backend's background reduce too, DESIGN §5): the survivors must abort it and
        # re-form without r, or their next reduce waits on a dead peer until it fails.
        out.append(Broadcast(DeclareDead(r)))
        if self.nccl and self.nccl_armed and self._all_acked():
            self.nccl_armed = False
        if self.phase != TRAINING:
            return
        if self.progressive:
            for e in sorted(self.pools):
                self.pools[e].forfeit(r)
            for s in range(self.ws):
                if not self._has_in_flight(s):
                    self._dispatch_next_chunk(s, now, out)
            return
        survivors = [s for s in range(self.ws) if alive[s]]
        if not survivors or not remainder:
            return
        total = sum(size for _, size in remainder)
        units = equal_sizes(total // self.bs, len(survivors))
        shares = split_ranges(remainder, [u * self.bs for u in units])
        for s, share in zip(survivors, shares):
            if not share:
                continue
            if self.np_inflight[s]:
                for off, size in share:
                    out.append(Send(s, ExtendPartition(off, size)))
                    self.np_inflight[s].append((off, size))
            else:
                self.np_queue[s].extend(share)
                self._np_send_next(s, out)

    def _unrecoverable_reason(self) -> SaveReason | None:
        dead = sum(self.dead)
        survivors = sum(self.alive_mask())
        mf = self.config.max_failure
        if mf is not None and mf.breached(dead, self.ws):
            return SaveReason.MAX_FAILURE_EXCEEDED
        if self.nccl and survivors < 2:
            return SaveReason.SINGLE_SURVIVOR
        if not self.nccl and survivors == 0:
            return SaveReason.ALL_RANKS_LOST
        return None

    def _next_generator(self, now: float, out: list[Out]) -> None:
        rz = self.rendezvous
        candidates = [r for r in range(self.ws) if self.alive(r) and r not in rz.tried]
        if not candidates:
            rz.generator = None
            self._shutdown_with_save(SaveReason.SINGLE_SURVIVOR, out)
            return

        def speed(r: int) -> tuple[float, int]:
            ms = self.elche.smoothed_ms(r)
            return (ms if ms is not None else math.inf, r)

        gen = min(candidates, key=speed)
        rz.tried.append(gen)
        rz.generator = gen
        rz.started_at = now
        out.append(Send(gen, RequestNewNcclId()))

    def _check_rendezvous_timeout(self, now: float, out: list[Out]) -> None:
        rz = self.rendezvous
        if rz.generator is None:
            return
        if not self.alive(rz.generator) or now - rz.started_at > self.config.rendezvous_timeout:
            self._next_generator(now, out)


def split_ranges(ranges: Sequence[Range], sizes: Sequence[int]) -> list[list[Range]]:
    """Cut ``ranges`` (in order) into consecutive shares of ``sizes`` samples each."""
    queue = deque(coalesce(ranges) if len(ranges) > 1 else [r for r in ranges if r[1] > 0])
    shares: list[list[Range]] = []
    for want in sizes:
        share: list[Range] = []
        while want > 0 and queue:
            off, size = queue[0]
            take = min(want, size)
            share.append((off, take))
            want -= take
            if take == size:
                queue.popleft()
            else:
                queue[0] = (off + take, size - take)
        shares.append(share)
    return shares
