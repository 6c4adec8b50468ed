"""``WorkerControl``: every rule of a rank's control protocol (seed 000, reference §3.5).

Sans-IO in the h11 manner. Two entry points, both pure decisions:

* ``route(msg, rank)`` (reader thread): what one wire control message means to the rank:
  liveness only, a dead peer, this rank declared dead, a session request or session, or
  a message for the core (the wire ``Update``'s next plan becomes a ``StartEpoch`` here).
* ``WorkerControl.dispatch(msg)`` (training thread): one control message in, a
  ``Dispatched`` out (upstream messages to publish, log lines to write, whether to stop,
  whether the rank is throttled). Every plan reaches the rank one way: a ``StartEpoch``
  dispatched into the one-slot mailbox, taken by the loop with ``take_pending_plan``.

Parameters are reached only through the injected ``ParamPort``; checkpoint, eval and save
through ``ModelPort``; elapsed times through an injected ``clock``. This module imports no
torch, no transport and no clock, and logs nothing itself (log lines are effects the
runtime writes), so replaying the same messages against ports that answer from the record
reproduces every decision.

The blocking parts of flodl's state machine (the Throttle receive loop, waiting for a
plan, the teardown drain) are the ``Phase`` here and the queue in ``worker.loop``. The
cpu param plane's thread (``params.cpu_avg``) only reports its round: it queues the
in-process ``Update`` (a ``Shutdown`` when the round failed), dispatched here like any
control message, and publishes its own ``SnapshotReady``/``SyncAck``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, assert_never

from flodl_bus.params.port import ParamPort
from flodl_bus.partition import SHUFFLE_BASE_SEED, make_partition
from flodl_bus.protocol import wire
from flodl_bus.protocol.messages import (
    ArmConsensusEval,
    ArmEpochEval,
    Batch,
    Checkpoint,
    ControlMsg,
    ControlWire,
    CoordHeartbeat,
    DeclareDead,
    EpochAggregated,
    EpochMetrics,
    EpochPlan,
    EvalBroadcast,
    ExecuteEvalCallback,
    ExtendPartition,
    LrUpdate,
    NewNcclSession,
    RequestNewNcclId,
    RequestParams,
    SaveConsensusModel,
    SetEpochCallbackRole,
    SetGlobalStep,
    Shutdown,
    ShutdownWithSave,
    StageAdvisory,
    StartEpoch,
    SyncAck,
    SyncNow,
    Throttle,
    Update,
    UpstreamMsg,
    WireUpdate,
)
from flodl_bus.worker import callbacks
from flodl_bus.worker.callbacks import Log as Log  # defined here before: re-exported
from flodl_bus.worker.ports import ModelPort, Stager

#: A Batch carries the L2 norm of the parameters when ``steps_since_avg`` is a multiple of
#: this (flodl: every 10th step), so the coordinator sees drift without a norm per step.
PARAM_NORM_EVERY: Final = 10


# ------------------------------------------------------------------------ routing


@dataclass(frozen=True, slots=True)
class Deliver:
    """Queue ``msg`` for the training thread. ``ends_run``: the coordinator is stopping
    the run, so its silence from now on is expected (no liveness escape)."""

    msg: ControlMsg
    ends_run: bool = False


@dataclass(frozen=True, slots=True)
class PeerDead:
    """``rank`` is dead: abort any collective with it (it would never complete)."""

    rank: int


@dataclass(frozen=True, slots=True)
class DeclaredDead:
    """The coordinator declared this rank dead (it was silent past the timeout): abort
    its collective, deliver ``Shutdown`` after what came before the notice, and route
    nothing more (what follows is the survivors' control)."""


@dataclass(frozen=True, slots=True)
class MakeSessionId:
    """Generate a fresh session uid and publish it (``NewNcclIdGenerated``)."""


@dataclass(frozen=True, slots=True)
class JoinSession:
    """Hand ``session`` to the param plane off the reader thread (latest wins)."""

    session: NewNcclSession


#: What the reader does with one wire control message; None: nothing (liveness only).
Routed = Deliver | PeerDead | DeclaredDead | MakeSessionId | JoinSession | None

_FOR_THE_CORE: Final = (
    RequestParams,
    StageAdvisory,
    SyncNow,
    StartEpoch,
    ShutdownWithSave,
    ExtendPartition,
    Throttle,
    SetGlobalStep,
    Checkpoint,
    ExecuteEvalCallback,
    ArmConsensusEval,
    ArmEpochEval,
    SetEpochCallbackRole,
    Shutdown,
    EpochAggregated,
    EvalBroadcast,
    SaveConsensusModel,
)


def route(msg: ControlWire, rank: int) -> Routed:
    """The reader's rule for one decoded control entry of ``rank``."""
    if isinstance(msg, CoordHeartbeat):
        return None  # liveness only: the read itself reset the clock
    if isinstance(msg, DeclareDead):
        return DeclaredDead() if msg.rank == rank else PeerDead(msg.rank)
    if isinstance(msg, RequestNewNcclId):
        return MakeSessionId()
    if isinstance(msg, NewNcclSession):
        return JoinSession(msg)
    if isinstance(msg, WireUpdate):
        # The param plane queued Update(avg) before its SyncAck, and the coordinator
        # sends this only after every SyncAck, so the core sees the averaged tensors
        # before the next plan. Without a plan it only says the round is over.
        return None if msg.next_plan is None else Deliver(StartEpoch(msg.next_plan))
    if isinstance(msg, _FOR_THE_CORE):
        return Deliver(msg, ends_run=isinstance(msg, (Shutdown, ShutdownWithSave)))
    assert_never(msg)


# ---------------------------------------------------------------------- the core


class Phase(enum.Enum):
    """Where the rank stands in its protocol."""

    #: trains its plan, or waits for one; control is serviced between batches
    RUNNING = "running"
    #: must not train: the loop blocks on control and feeds every message here until a
    #: release (the end of an averaging round, or a stop) — flodl's nested receive loop
    THROTTLED = "throttled"
    #: told to stop (or its control channel died): the loop ends; at teardown only a
    #: queued shutdown is still acted on (``acts_at_teardown``)
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class Dispatched:
    """What the runtime must do after one dispatch.

    ``throttled`` is the phase *after* the dispatch: while it is True the runtime must
    block on its control queue and keep feeding ``dispatch``, because a throttled rank
    must not train.
    """

    upstream: tuple[UpstreamMsg, ...] = ()
    stop: bool = False
    throttled: bool = False
    logs: tuple[Log, ...] = ()


_NOTHING: Final = Dispatched()
_STOP: Final = Dispatched(stop=True)


def acts_at_teardown(msg: ControlMsg) -> bool:
    """Teardown rule: a queued ``ShutdownWithSave`` (the bundle is written) or
    ``Shutdown`` is dispatched; everything else is dropped (training is over)."""
    return isinstance(msg, (ShutdownWithSave, Shutdown))


class WorkerControl:
    """One rank's protocol state and every rule that changes it."""

    def __init__(
        self,
        *,
        rank: int,
        params: ParamPort,
        batch_size: int,
        pick_space: int,
        clock: Callable[[], float],
        model: ModelPort | None = None,
        stager: Stager | None = None,
        seed: int = SHUFFLE_BASE_SEED,
        splits: int = 1,
        lr_every_step: bool = False,
        plans_wait_for_update: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.rank = rank
        self.params = params
        self.model = model
        self.stager = stager
        self.batch_size = batch_size
        self.pick_space = pick_space
        self.seed = seed
        self.splits = splits
        self._clock = clock
        self.phase = Phase.RUNNING

        # Step accounting (reference §3.8).
        self.local_step = 0
        self.steps_since_avg = 0
        self.steps_at_snapshot = 0
        self.global_step = 0
        self.current_version = 0
        #: report the LR after every step, changed or not (flodl's piggyback; records
        #: made before the LR was reported only on a change replay with it)
        self.lr_every_step = lr_every_step
        #: cpu-cadence: a plan is not taken between the round's snapshot and its Update
        #: (the coordinator sends the next plan right behind RequestParams, and adoption
        #: overwrites the parameters: a step taken before it would be lost). Records
        #: made before it have no such plans and replay with it off
        self.plans_wait_for_update = plans_wait_for_update
        self.awaiting_update = False
        self._last_lr: float | None = None

        # The plan being trained and its expanded picks (grown by ExtendPartition).
        self.current_epoch = 0
        self.partition: list[int] = []
        #: the one-slot mailbox of the next plan: one chunk in flight (reference §3.9)
        self.pending_plan: EpochPlan | None = None

        # Stored for the user / the main loop.
        self.epoch_callback_role: int | None = None
        self.aggregated_metrics: EpochMetrics | None = None
        self.last_eval_broadcast: tuple[int, float] | None = None
        self.pending_consensus_eval: tuple[int, int] | None = None
        #: (schedule_id, epoch): the eval that epoch's start owes, armed by a plan sent
        #: before that start (``eval_due``)
        self.pending_epoch_eval: tuple[int, int] | None = None

    @property
    def throttled(self) -> bool:
        return self.phase is Phase.THROTTLED

    # ------------------------------------------------------------------ dispatch

    def dispatch(self, msg: ControlMsg) -> Dispatched:
        """Apply one control message. Exceptions from the ports propagate (a failed
        collective or a mismatched average is fatal to the rank, as in flodl)."""
        phase = self.phase
        if phase is Phase.THROTTLED:
            return self._dispatch_throttled(msg)
        if isinstance(msg, Throttle):
            if phase is Phase.STOPPED:
                return _STOP  # nothing left to pause
            # Entering: the runtime now blocks and feeds us until a release.
            self.phase = Phase.THROTTLED
            return Dispatched(throttled=True)
        out = self._apply(msg)
        if out.stop:
            self.phase = Phase.STOPPED
        return out

    def _dispatch_throttled(self, msg: ControlMsg) -> Dispatched:
        # Throttle never nests. Everything else is serviced, so the reduce that will
        # release us (RequestParams, a StartEpoch for the next chunk) can complete; only
        # the end of an averaging round or a stop lets the rank go on.
        if isinstance(msg, Throttle):
            return Dispatched(throttled=True)
        out = self._apply(msg)
        if out.stop:
            self.phase = Phase.STOPPED
            return out
        if isinstance(msg, (SyncNow, Update, Shutdown)):
            self.phase = Phase.RUNNING
            return out
        return Dispatched(upstream=out.upstream, throttled=True, logs=out.logs)

    def channel_closed(self) -> Dispatched:
        """The control channel is gone (reader dead): nothing can release us any more."""
        self.phase = Phase.STOPPED
        return _STOP

    def _apply(self, msg: ControlMsg) -> Dispatched:
        if isinstance(msg, RequestParams):
            # The matching Update subtracts exactly what this snapshot ships, so steps
            # taken during the round trip keep their mass for the next round.
            self.steps_at_snapshot = self.steps_since_avg
            self.params.snapshot(self.steps_since_avg)
            self.awaiting_update = self.plans_wait_for_update
            return _NOTHING

        if isinstance(msg, Update):
            return self._adopt(msg)

        if isinstance(msg, SyncNow):
            result = self.params.sync_now(self.steps_since_avg)
            # The collective is synchronous: nothing stepped meanwhile, zero is exact.
            self.steps_since_avg = 0
            self.steps_at_snapshot = 0
            # A SyncAck (never a Batch: a Batch would add a phantom step to the global
            # step and run the LR schedule early) with a bumped step so the coordinator's
            # `step_count > snapshot` ack rule holds even when no batch follows.
            self.local_step += 1
            ack = SyncAck(
                rank=self.rank,
                step_count=self.local_step,
                divergence=result.divergence,
                post_norm=result.post_norm,
                pre_norm=result.pre_norm,
            )
            return Dispatched(upstream=(ack,))

        if isinstance(msg, StartEpoch):
            old, self.pending_plan = self.pending_plan, msg.plan
            if old is None:
                return _NOTHING
            # Overwriting an unconsumed plan strands a chunk the coordinator counts as
            # in flight, wedging its reduce gate. Make it loud; keep the newer plan
            # because the coordinator's bookkeeping tracks the newest dispatch.
            violated = Log(
                "error",
                "one_chunk_in_flight_violated",
                {
                    "rank": self.rank,
                    "dropped_plan": wire.plan_to_map(old),
                    "kept_plan": wire.plan_to_map(msg.plan),
                    "detail": "StartEpoch overwrote an unconsumed plan; a chunk was dropped",
                },
            )
            return Dispatched(logs=(violated,))

        if isinstance(msg, ExtendPartition):
            # Same epoch, seed, pick space and splits as the plan's own expansion, so the
            # appended picks line up with every other rank's view of the permutation.
            self.partition.extend(
                make_partition(
                    msg.partition_offset,
                    msg.partition_size,
                    self.pick_space,
                    self.current_epoch,
                    self.seed,
                    self.splits,
                )
            )
            return _NOTHING

        if isinstance(msg, ShutdownWithSave):
            return Dispatched(stop=True, logs=callbacks.save_bundle(self.model, self.rank, msg))

        if isinstance(msg, SetGlobalStep):
            self.global_step = msg.global_step
            return _NOTHING

        if isinstance(msg, Checkpoint):
            if msg.target_rank != self.rank:
                return _NOTHING
            return Dispatched(
                upstream=(callbacks.checkpoint(self.model, self.rank, msg.version, self._clock),)
            )

        if isinstance(msg, ExecuteEvalCallback):
            armed = self.pending_epoch_eval
            if armed is not None and msg.target_rank == self.rank and msg.epoch >= armed[1]:
                self.pending_epoch_eval = None  # served (``eval_due``)
            if msg.target_rank != self.rank or self.model is None or not self.model.has_eval_fn:
                # Not the evaluator, or a rank without an eval callback: silent no-op.
                return _NOTHING
            return Dispatched(
                upstream=(callbacks.evaluate(self.model, self.rank, msg, self._clock),)
            )

        if isinstance(msg, ArmConsensusEval):
            if msg.target_rank == self.rank:
                self.pending_consensus_eval = (msg.schedule_id, msg.epoch)
            return _NOTHING

        if isinstance(msg, ArmEpochEval):
            if msg.target_rank == self.rank:
                self.pending_epoch_eval = (msg.schedule_id, msg.epoch)
            return _NOTHING

        if isinstance(msg, SetEpochCallbackRole):
            self.epoch_callback_role = msg.rank
            return _NOTHING

        if isinstance(msg, Shutdown):
            return _STOP

        if isinstance(msg, EpochAggregated):
            self.aggregated_metrics = msg.metrics
            return _NOTHING

        if isinstance(msg, EvalBroadcast):
            self.last_eval_broadcast = (msg.epoch, msg.metric)
            return _NOTHING

        if isinstance(msg, SaveConsensusModel):
            # Broadcast: its target writes the model, every rank its own state (a
            # resume from any save restores each rank's optimizer and random state).
            logs = (
                callbacks.save_consensus(self.model, self.rank)
                if msg.target_rank == self.rank
                else ()
            )
            return Dispatched(logs=logs + callbacks.save_rank_state(self.model, self.rank))

        if isinstance(msg, StageAdvisory):
            if self.stager is not None:
                self.stager.advise(msg)
            return _NOTHING

        if isinstance(msg, Throttle):
            # Phase transitions are ``dispatch``'s; here a Throttle changes nothing.
            return _NOTHING

        assert_never(msg)

    def _adopt(self, msg: Update) -> Dispatched:
        self.params.load_averaged(msg.avg)
        self.awaiting_update = False
        # Subtract, never zero: cpu-async overshoot steps survive the blend. The marker
        # reset makes a duplicate Update subtract 0.
        self.steps_since_avg = max(0, self.steps_since_avg - self.steps_at_snapshot)
        self.steps_at_snapshot = 0
        self.current_version = msg.avg.version
        armed = self.pending_consensus_eval
        if armed is None or not msg.avg.realized:
            # An unrealized round is the rank's own state, not a consensus: the armed
            # eval waits for the next realized one.
            return _NOTHING
        self.pending_consensus_eval = None
        if self.model is None or not self.model.has_eval_fn:
            return _NOTHING
        # Scored right after adoption, before any further step, as the consensus: under
        # overwrite adoption the model is this round's consensus already; under the
        # cpu-async EASGD blend it is not, and the port swaps the consensus in.
        schedule_id, epoch = armed
        eval_msg = ExecuteEvalCallback(schedule_id, epoch, self.rank, adopt_consensus=True)
        return Dispatched(
            upstream=(callbacks.evaluate(self.model, self.rank, eval_msg, self._clock),)
        )

    # ------------------------------------------------------------- plan and steps

    def take_pending_plan(self) -> EpochPlan | None:
        """The plan to train next, emptying the mailbox (None: keep waiting)."""
        if self.awaiting_update:
            return None  # held until the round's Update (``plans_wait_for_update``)
        plan, self.pending_plan = self.pending_plan, None
        return plan

    def eval_due(self) -> ExecuteEvalCallback | None:
        """The eval armed for the start of the plan about to be taken (its epoch or an
        earlier one's), which the runtime dispatches before taking it; None when none
        is due. Dispatching it disarms it, so a record replays it as any dispatch."""
        armed, plan = self.pending_epoch_eval, self.pending_plan
        if armed is None or plan is None or self.awaiting_update or plan.epoch < armed[1]:
            return None
        return ExecuteEvalCallback(armed[0], armed[1], self.rank)

    def begin_plan(self, plan: EpochPlan) -> list[int]:
        """Expand ``plan`` into this rank's picks; ExtendPartition appends to them."""
        self.current_epoch = plan.epoch
        self.partition = make_partition(
            plan.partition_offset,
            plan.partition_size,
            self.pick_space,
            plan.epoch,
            self.seed,
            self.splits,
        )
        return self.partition

    @property
    def num_batches(self) -> int:
        """Full batches in the live partition; re-read every iteration (ExtendPartition)."""
        return len(self.partition) // self.batch_size

    def batch_picks(self, index: int) -> list[int]:
        bs = self.batch_size
        return self.partition[index * bs : (index + 1) * bs]

    @property
    def lr_position(self) -> int:
        """Where every rank's identical LR schedule is read (reference §3.13)."""
        return self.global_step + self.steps_since_avg

    def step_done(
        self, batch_loss: float, batch_ms: float, data_ms: float, lr: float
    ) -> tuple[Batch, LrUpdate | None]:
        """Account one optimizer step and build its reports: a ``Batch``, and an
        ``LrUpdate`` when the LR is news (the first step's, or one that changed). The
        coordinator keeps each rank's last LR; an unchanged one sent after every step
        was half of a rank's upstream traffic for nothing (issue 27)."""
        self.local_step += 1
        self.steps_since_avg += 1
        norm = self.params.param_norm() if self.steps_since_avg % PARAM_NORM_EVERY == 0 else None
        news = self.lr_every_step or lr != self._last_lr
        self._last_lr = lr
        return (
            Batch(
                rank=self.rank,
                batch_ms=batch_ms,
                data_ms=data_ms,
                step_count=self.local_step,
                batch_loss=batch_loss,
                param_norm=norm,
            ),
            LrUpdate(rank=self.rank, lr=lr) if news else None,
        )

    def state(self) -> dict[str, Any]:
        """The fields a recorder logs before/after a dispatch."""
        return {
            "local_step": self.local_step,
            "steps_since_avg": self.steps_since_avg,
            "steps_at_snapshot": self.steps_at_snapshot,
            "global_step": self.global_step,
            "current_version": self.current_version,
            "current_epoch": self.current_epoch,
            "partition_len": len(self.partition),
            "pending_plan": None
            if self.pending_plan is None
            else wire.plan_to_map(self.pending_plan),
            "throttled": self.throttled,
            "epoch_callback_role": self.epoch_callback_role,
        }
