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

from collections.abc import Mapping
from itertools import compress, count, repeat
from operator import gt, lt
from typing import Any, assert_never

from flodl_bus.coordinator.checkpoint import Checkpoints, read_meta
from flodl_bus.coordinator.config import Backend, CoordinatorConfig, Policy
from flodl_bus.coordinator.dispatch import PoolDispatch
from flodl_bus.coordinator.dispatch_api import Dispatch
from flodl_bus.coordinator.effects import Alert, Broadcast, Finished, Out, Send, WriteMeta
from flodl_bus.coordinator.elche import ElChe
from flodl_bus.coordinator.guard import STABLE, Verdict, make_guard
from flodl_bus.coordinator.ledger import Ledger
from flodl_bus.coordinator.liveness import Liveness
from flodl_bus.coordinator.meta import MetaController
from flodl_bus.coordinator.metrics import EpochBuffer, aggregate
from flodl_bus.coordinator.partition import PartitionDispatch
from flodl_bus.coordinator.reduce import (
    OVERSHOOT_START,
    CpuReduce,
    NcclReduce,
    Reduce,
    SoloReduce,
)
from flodl_bus.coordinator.roles import Roles
from flodl_bus.coordinator.summary import Summarizer
from flodl_bus.protocol import leaving
from flodl_bus.protocol.messages import (
    FINAL_EVAL_SCHEDULE,
    ArmEpochEval,
    Batch,
    Checkpoint,
    CheckpointResult,
    CoordHeartbeat,
    DeclareDead,
    EpochAggregated,
    EpochFnElapsed,
    EvalBroadcast,
    EvalResult,
    ExecuteEvalCallback,
    Exiting,
    Heartbeat,
    Intent,
    IntentKind,
    LrUpdate,
    MetricsMsg,
    NewNcclIdGenerated,
    NewNcclSession,
    RequestNewNcclId,
    ResourceSample,
    SaveReason,
    SetEpochCallbackRole,
    SetGlobalStep,
    Shutdown,
    ShutdownWithSave,
    SnapshotReady,
    StartEpoch,
    SyncAck,
    UpstreamMsg,
    WireUpdate,
)

TRAINING = "training"
FINAL_EVAL = "final_eval"
SHUTDOWN = "shutdown"


class Coordinator:
    """Routes each upstream message and tick to its rule; the rules' state lives in
    ``live`` (liveness), ``dispatch`` (who trains what), ``reduce`` (the averaging
    cycle) and ``checkpoints``, each chosen once from the config."""

    def __init__(self, config: CoordinatorConfig) -> None:
        cfg = config
        self.config = cfg
        self.ws = ws = cfg.world_size
        self.policy = cfg.policy
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
            speed_hints=cfg.speed_hints,
            # Partition ratios name the slow rank too (flodl pins it from them): the
            # user's word outranks the spec prior, as speed hints do inside ElChe.
            device_scores=cfg.device_scores if cfg.partition_ratios is None else None,
            dead_zone_keeps_five_percent=cfg.dead_zone_keeps_five_percent,
            flodl_election=cfg.elche_flodl_election,
        )
        self.guard = make_guard(cfg)
        self.meta = MetaController(cfg.meta_controller)
        self.roles = Roles(ws, cfg.epoch_callback_rank)
        self.metrics = EpochBuffer(ws)
        #: each rank's newest resource sample, for ``flodl-bus status``; kept out of the
        #: state summary, which records made before resources existed replay against
        self.resources: list[ResourceSample | None] = [None] * ws
        self.version = 0
        self.avg_count = 0
        self.global_step = 0
        self.ledger = Ledger(ws)
        self.last_lr: list[float | None] = [None] * ws
        self.last_aggregated = -1
        self.start_epoch = 0
        #: the last epoch whose callbacks were scheduled
        self.hooked_epoch = -1
        self.max_overshoot = cfg.max_overshoot if cfg.max_overshoot is not None else OVERSHOOT_START
        self.overshoot_auto = cfg.max_overshoot is None and self.policy is Policy.ASYNC
        self.last_verdict: Verdict = STABLE
        # lifecycle (§4.16)
        self.phase = TRAINING
        self.finished = False
        self.finish_reason: SaveReason | None = None
        #: why a rank refused the run's setup (``leaving.CONFIG_ERROR``), if one did
        self.refused: str | None = None
        #: the rank the final eval went to; if it dies, the run stops waiting for it
        self.final_eval_rank: int | None = None
        self.final_eval_done = False
        self.lost_sends = 0
        self._last_coord_hb = 0.0
        self._started = False
        self.live = Liveness(ws)
        self.checkpoints = Checkpoints(self)
        self.dispatch: Dispatch = (
            PoolDispatch(self) if cfg.is_progressive else PartitionDispatch(self)
        )
        self.reduce: Reduce
        #: a world of one that closes windows without rounds (``SoloReduce``)
        self.solo = ws == 1 and cfg.solo_without_rounds
        if self.solo:
            self.reduce = SoloReduce(self, adopts_consensus=cfg.backend is Backend.CPU)
        elif cfg.backend is Backend.NCCL:
            self.reduce = NcclReduce(self)
        else:
            self.reduce = CpuReduce(self)
        #: cpu-cadence draws each rank's next chunk at the round's trigger (``_trigger``)
        self.plans_with_request = (
            cfg.plans_with_request
            and isinstance(self.reduce, CpuReduce)
            and cfg.policy is Policy.CADENCE
            and isinstance(self.dispatch, PoolDispatch)
        )
        self.summarizer = Summarizer(self)

    @classmethod
    def from_meta(cls, config: CoordinatorConfig, meta: Mapping[str, Any]) -> Coordinator:
        """Resume: rebuild counters and pools so only the uncovered samples are trained."""
        core = cls(config)
        core.checkpoints.restore(read_meta(config, meta))
        return core

    # ================================================================= public surface
    def alive(self, r: int) -> bool:
        return self.live.alive[r]

    def alive_ranks(self) -> list[int]:
        return self.live.alive_ranks()

    def alive_mask(self) -> list[bool]:
        return list(self.live.alive)

    @property
    def training(self) -> bool:
        return self.phase == TRAINING

    @property
    def resume_holes(self) -> dict[int, list[tuple[int, int]]]:
        return self.checkpoints.resume_holes

    def start(self, now: float) -> list[Out]:
        """First dispatch: roles, then epoch ``start_epoch``'s plans or chunks."""
        out: list[Out] = []
        self._started = True
        self.live.last_heartbeat = [now] * self.ws
        self._last_coord_hb = now
        if self.global_step:
            out.append(Broadcast(SetGlobalStep(self.global_step)))
        if self.start_epoch < self.config.num_epochs:
            self.dispatch.start(now, out)
        self.dispatch.aggregate_ready(now, out)
        self._advance(now, out, aggregated=True)
        return out

    def handle(self, rank: int, msg: UpstreamMsg, now: float) -> list[Out]:
        """Apply one upstream message from ``rank``'s stream."""
        out: list[Out] = []
        if not 0 <= rank < self.ws:
            out.append(Alert("warn", "unknown_rank", f"message from rank {rank}"))
            return out
        self.live.heard_from(rank, now)
        if self.live.dead[rank]:
            # No resurrection: the rank's work was already handed to survivors.
            return out
        if isinstance(msg, Batch):
            self.ledger.record_batch(rank, msg.batch_ms, msg.data_ms, msg.batch_loss)
            self.dispatch.on_batch(rank, now, out)
            self.reduce.on_batch(rank, msg.step_count, now)
        elif isinstance(msg, Heartbeat):
            pass
        elif isinstance(msg, LrUpdate):
            self.last_lr[rank] = msg.lr
        elif isinstance(msg, MetricsMsg):
            if msg.resources is not None:
                self.resources[rank] = msg.resources
            self.metrics.record(rank, msg)
            self.dispatch.on_metrics(rank, msg, now, out)
        elif isinstance(msg, SyncAck):
            self.reduce.on_sync_ack(rank, msg, now)
        elif isinstance(msg, Exiting):
            if self.phase == SHUTDOWN or not self.alive(rank):
                self._on_exiting(rank, out)
            else:
                # A clean leave comes only after the run's Shutdown: one before it (a
                # rank that lost its reader, an entry of a stale process) left work
                # undone, which must be handed on like a death's, not waited for.
                why = msg.reason or leaving.reason(
                    leaving.RANK_FAILED, "left before the run's end without a reason"
                )
                self._on_leaving(rank, why, now, out)
        elif isinstance(msg, Intent):
            if msg.kind is IntentKind.EVAL_NOW:
                self.roles.pending_eval_intent = True
            else:
                self.roles.pending_checkpoint_intent = True
        elif isinstance(msg, SnapshotReady):
            self.reduce.on_snapshot_ready(rank, now)
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
            assert_never(msg)
        return out

    def tick(self, now: float, *, behind: bool = False) -> list[Out]:
        """Periodic work in the reference's order (§4.2). ``behind``: the runtime's last
        read may have left entries waiting (``CoordinatorBus.behind``); a rank's silence
        then may be the coordinator's own backlog, so no rank is declared dead for it
        until a tick that is not behind (4,096 simulated ranks on one coordinator: a
        pass longer than the heartbeat timeout declared every live rank dead)."""
        out: list[Out] = []
        if self.finished or not self._started:
            return out
        if now - self._last_coord_hb >= self.config.coord_heartbeat_every:
            self._last_coord_hb = now
            out.append(Broadcast(CoordHeartbeat()))
        if self.config.elastic and not behind:
            self._check_dead_ranks(now, out)
        if self.finished:
            return out
        if self.live.rendezvous_expired(now, self.config.rendezvous_timeout):
            self._next_generator(now, out)
        if self.finished:
            return out
        self.dispatch.retry(now, out)
        self.reduce.check_throttle(out)
        self.reduce.poll(now, out)
        if self.finished:
            return out
        # With plans drawn at the trigger, the epoch a round closes is aggregated
        # before it: the round's plans may then come from the next epoch.
        aggregated = self.plans_with_request and self.dispatch.aggregate_ready(now, out)
        if not self.should_average():
            self.reduce.wait_since = None
        elif self.reduce.window_ready(now, self.ledger):
            self._trigger(now, out)
        aggregated = self.dispatch.aggregate_ready(now, out) or aggregated
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
            self.dispatch.rollback(rank, plan)
        if self.phase != SHUTDOWN:
            out.append(Alert("warn", "control_drop", f"{type(msg).__name__} to rank {rank}"))
        return out

    # ----------------------------------------------------------------- the gate (§4.5)
    def gate(self) -> tuple[bool, str]:
        """Whether a reduce may fire now, and if not, why (for the recorder)."""
        if self.phase == SHUTDOWN:
            return False, "shutdown"
        if self.reduce.in_flight:
            return False, "cpu cycle in flight"
        if self.live.active_count == 0:
            return False, "no active rank"
        sync = self.policy is Policy.SYNC
        counts = self.elche.counts
        steps = self.ledger.steps
        alive = self.live.alive
        if not self.reduce.any_blocks():
            # Then only a rank short of its steps can shut the gate: C finds those (this
            # runs for every recorded message, over every rank), and of those only a
            # live one the dispatch does not spare.
            spares = self.dispatch.spares_gate
            for r in compress(count(), map(lt, steps, repeat(1) if sync else counts)):
                if alive[r] and not spares(r):
                    return False, f"rank {r} at {steps[r]}/{1 if sync else counts[r]} steps"
            return self._moved(steps, alive)
        for r in range(self.ws):
            if not alive[r]:
                continue
            if self.reduce.blocks(r):
                return False, f"rank {r} has not acked the last SyncNow"
            s = steps[r]
            need = 1 if sync else counts[r]
            if s >= need:
                continue
            if self.dispatch.spares_gate(r):
                continue
            return False, f"rank {r} at {s}/{need} steps"
        return self._moved(steps, alive)

    @staticmethod
    def _moved(steps: list[int], alive: list[bool]) -> tuple[bool, str]:
        # Stops at the first live rank that moved (rank 0, as a rule): max() read them all.
        if not any(map(gt, compress(steps, alive), repeat(0))):
            return False, "no rank moved"
        return True, "open"

    def should_average(self) -> bool:
        return self.gate()[0]

    # ----------------------------------------------------------------- summary
    def state_summary(self, reuse: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The decision-relevant state (the record's ``before``/``after``). ``reuse``: an
        earlier summary (never changed since) whose per-rank lists are handed back where
        they still hold, so an unchanged list is neither copied nor compared again by
        the recorder (``record.states``); from the previous summary built so, only the
        entries written since are read (``coordinator.summary``)."""
        return self.summarizer.build(reuse)

    def summary_changes(
        self, after: Mapping[str, Any], before: Mapping[str, Any]
    ) -> dict[str, list[int] | None] | None:
        """Where ``after``'s lists differ from ``before``'s, if ``after`` was built from
        ``before`` (``Summarizer.changes``), for the recorder's delta."""
        return self.summarizer.changes(after, before)

    def summary_patches(
        self, after: Mapping[str, Any], before: Mapping[str, Any]
    ) -> dict[str, list[Any]] | None:
        """The entries set in place between ``before`` and ``after`` (the summarizer's
        ``mirror``; ``Summarizer.patches``), for the recorder's delta; None where the
        mirror is off or ``after`` was not built from ``before``."""
        if not self.summarizer.mirror:
            return None
        return self.summarizer.patches(after, before)

    def summary_delta(
        self, after: Mapping[str, Any], before: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """The record's delta from ``before`` to ``after`` where the summarizer knew it
        as it built ``after`` (``Summarizer.delta``: the mirror on, no list replaced),
        else None."""
        return self.summarizer.delta(after, before)

    # ================================================================= upstream
    def _on_exiting(self, r: int, out: list[Out]) -> None:
        if self.live.mark_exited(r):
            self.reduce.on_gone(r, out, exiting=True)

    def _on_leaving(self, r: int, reason: str, now: float, out: list[Out]) -> None:
        """A rank leaving mid-run said why (``protocol.leaving``)."""
        if leaving.kind_of(reason) == leaving.CONFIG_ERROR:
            # Set up wrong (a resume that does not fit the job): every rank is, and a
            # save would overwrite the checkpoint; the run stops with the config code.
            self.refused = leaving.detail_of(reason)
            out.append(Alert("critical", "config_error", f"rank {r}: {self.refused}"))
            self._on_exiting(r, out)
            out += self.interrupt(now)
            return
        if leaving.kind_of(reason) == leaving.JOB_FAILED:
            # The job's code is the same on every rank: what failed here fails there
            # too, so the run stops (with its save) instead of re-forming around it.
            out.append(Alert("critical", "job_failed", f"rank {r}: {leaving.detail_of(reason)}"))
            self._on_exiting(r, out)
            self.shutdown_with_save(SaveReason.JOB_FAILED, out)
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
        out.append(Alert("warn", "checkpoint_failed", f"rank {r}: {msg.error}"))
        nxt = self.roles.checkpoint_failed(r, self.alive_mask())
        if nxt is None:
            out.append(Alert("warn", "checkpoint_gave_up", f"version {msg.version}"))
        else:
            out.append(Send(nxt, Checkpoint(msg.version, nxt)))

    def _on_nccl_id(self, r: int, msg: NewNcclIdGenerated, out: list[Out]) -> None:
        rz = self.live.rendezvous
        if rz.generator != r:
            out.append(Alert("warn", "stray_nccl_id", f"from rank {r}"))
            return
        survivors = [s for s in range(self.ws) if self.alive(s)]
        rz.reset()
        if len(survivors) < self.reduce.min_survivors:
            self.shutdown_with_save(SaveReason.SINGLE_SURVIVOR, out)
            return
        for i, s in enumerate(survivors):
            out.append(Send(s, NewNcclSession(msg.uid_bytes, i, len(survivors))))

    # ================================================================= reduce (§4.6)
    def _trigger(self, now: float, out: list[Out]) -> None:
        closed = self.ledger
        self.ledger = Ledger(self.ws)
        self.reduce.trigger(now, closed, self.checkpoints.arm(), out)
        if self.plans_with_request:
            # Each rank's next chunk rides behind the RequestParams, drawn from the
            # counts the round is closing with: the rank trains it at once and keeps
            # those steps on top of the consensus (``--overlap-rounds``), or holds it
            # until the round's Update; either way it no longer waits out SyncAck ->
            # coordinator -> Update -> its read for work (issue 27).
            self.dispatch.prefetch(now, out)

    # ----------------------------------------------------------------- epoch hooks
    def epoch_hooks(self, epoch: int, out: list[Out], *, armed: bool = False) -> None:
        """Once per epoch, before its first plan: role broadcast, callbacks (§4.10.7).
        ``armed``: the plan goes out before the epoch starts (``hooks_armable``), so its
        eval is armed to run at that start rather than on receipt."""
        roles = self.roles
        if roles.dirty:
            out.append(Broadcast(SetEpochCallbackRole(roles.epoch_callback)))
            roles.dirty = False
        if epoch <= self.hooked_epoch:
            return
        self.hooked_epoch = epoch
        cfg = self.config
        if epoch == 0:
            return
        if self._checkpoint_due(epoch):
            roles.pending_checkpoint_intent = False
            out.append(Send(roles.checkpoint, Checkpoint(epoch, roles.checkpoint)))
            self.checkpoints.request(out)
        if bool(cfg.eval_every and epoch % cfg.eval_every == 0) or roles.pending_eval_intent:
            if armed:
                roles.pending_eval_intent = False
                out.append(Send(roles.eval, ArmEpochEval(epoch, epoch, roles.eval)))
            else:
                self.reduce.schedule_eval(epoch, out)

    def hooks_armable(self, epoch: int) -> bool:
        """Whether ``epoch``'s start can be planned before it comes: its hooks ask for
        nothing but an eval (a checkpoint is of the model at that start, and a rank
        takes it on receipt)."""
        return epoch <= self.hooked_epoch or epoch == 0 or not self._checkpoint_due(epoch)

    def _checkpoint_due(self, epoch: int) -> bool:
        cfg = self.config
        return bool(
            (cfg.checkpoint_every and epoch % cfg.checkpoint_every == 0)
            or epoch in cfg.checkpoint_at_epoch
            or self.roles.pending_checkpoint_intent
        )

    # ----------------------------------------------------------------- aggregation (§4.11)
    def publish_epoch(self, epoch: int, epoch_ms: float | None, out: list[Out]) -> None:
        accs = self.metrics.pop(epoch)
        em = aggregate(epoch, accs, self.elche.recent_batch_share(), epoch_ms)
        self.last_aggregated = epoch
        out.append(Broadcast(EpochAggregated(em)))

    # ----------------------------------------------------------------- end of run (§4.16)
    def _advance(self, now: float, out: list[Out], aggregated: bool) -> None:
        if self.phase == SHUTDOWN or self.reduce.in_flight:
            return
        if self.last_aggregated >= self.config.num_epochs - 1:
            self._maybe_shutdown(now, out)
            return
        self.dispatch.advance(now, out, aggregated)

    def _maybe_shutdown(self, now: float, out: list[Out]) -> None:
        alive = [r for r in range(self.ws) if self.alive(r)]
        if self.phase == TRAINING:
            trailing = any(self.ledger.steps[r] > 0 for r in alive)
            # A world of one closes its last window too (no round: its global step).
            if (len(alive) >= 2 or self.solo) and trailing:
                # Final consensus reduce, while idle ranks still service control.
                # Its consensus is saved by ``checkpoints.final`` once it closed, as a
                # graceful shutdown's (not as a mid-run checkpoint) whether or not the
                # end had a window left to close.
                if self.reduce.settled() and self.reduce.window_ready(now, self.ledger):
                    if not self.config.final_round_saves_graceful:
                        self.checkpoints.due = self.checkpoints.due or self.checkpoints.enabled
                    self._trigger(now, out)
                return
            if self.config.final_eval and self.alive(self.roles.eval):
                self.phase = FINAL_EVAL
                target = self.roles.eval
                self.final_eval_rank = target
                adopt = self.reduce.adopts_consensus
                num = self.config.num_epochs
                out.append(
                    Send(target, ExecuteEvalCallback(FINAL_EVAL_SCHEDULE, num, target, adopt))
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
        if not self.reduce.settled():
            return
        self.checkpoints.final(out)
        self.phase = SHUTDOWN
        self.finished = True
        out.append(Broadcast(Shutdown()))
        out.append(Finished(None))

    def shutdown_with_save(self, reason: SaveReason, out: list[Out]) -> None:
        if self.phase == SHUTDOWN:
            return
        out.append(WriteMeta(self.checkpoints.meta(reason, self.checkpoints.coverage())))
        out.append(Broadcast(ShutdownWithSave(reason)))
        self.phase = SHUTDOWN
        self.finished = True
        self.finish_reason = reason
        out.append(Finished(reason))

    # ================================================================= liveness (§4.15)
    def _check_dead_ranks(self, now: float, out: list[Out]) -> None:
        died = self.live.silent(now, self.config.heartbeat_timeout)
        for r in died:
            self._process_death(r, now, out)
        if died and self.phase != SHUTDOWN:
            self._after_deaths(now, out)

    def _after_deaths(self, now: float, out: list[Out]) -> None:
        """Stop with a save if the survivors cannot go on, else re-form their group."""
        reason = self.live.unrecoverable(self.config.max_failure, self.reduce.min_survivors)
        if reason is not None:
            self.shutdown_with_save(reason, out)
        else:
            self.live.rendezvous.reset()
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
        remainder = self.dispatch.take_back(r)
        self.live.mark_dead(r)
        alive = self.alive_mask()
        self.elche.forget(r)
        self.roles.on_death(r, alive, self.elche.fastest(alive))
        # Both backends average through one collective group of the ranks (the cpu
        # backend's background reduce too, DESIGN §5): the survivors must abort it and
        # re-form without r, or their next reduce waits on a dead peer until it fails.
        self.reduce.on_gone(r, out, exiting=False)
        out.append(Broadcast(DeclareDead(r)))
        if self.phase == TRAINING:
            self.dispatch.reassign(r, remainder, now, out)

    def _next_generator(self, now: float, out: list[Out]) -> None:
        gen = self.live.next_generator(now, self.elche.smoothed_ms)
        if gen is None:
            self.shutdown_with_save(SaveReason.SINGLE_SURVIVOR, out)
        else:
            out.append(Send(gen, RequestNewNcclId()))
