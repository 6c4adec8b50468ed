"""A tiny deterministic cluster: simulated ranks that obey the rank state machine.

Each ``SimRank`` behaves like seed 000's ``dispatch_control`` around ``wait_for_epoch_plan``
and ``run_epoch_plan``: one pending-plan slot, SyncNow as a blocking collective that
completes when every live rank has entered it, RequestParams as a CPU round that
completes (Update injected, then SyncAck) once every live rank has snapshotted, the
Throttle loop released by SyncNow/Update/Shutdown, ExtendPartition through the shared
permutation, Exiting on a clean Shutdown. Time advances in 1 ms ticks; a rank's batch
takes ``speed`` ticks. The coordinator core is driven exactly as its runtime would be.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from flodl_bus.coordinator.config import CoordinatorConfig
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.effects import Broadcast, Finished, Out, Send, WriteMeta
from flodl_bus.partition import epoch_span, make_partition
from flodl_bus.protocol import messages as m


@dataclass
class _InProcUpdate:
    """The param plane's in-process Update(avg) (no tensors in the simulation)."""

    round: int


@dataclass
class SimRank:
    rank: int
    speed: int
    cfg: CoordinatorConfig
    queue: deque[object] = field(default_factory=deque)
    pending_plan: m.EpochPlan | None = None
    plan: m.EpochPlan | None = None
    partition: list[int] = field(default_factory=list)
    batch_idx: int = 0
    busy_until: int | None = None
    plan_started: int = 0
    plan_loss: float = 0.0
    local_step: int = 0
    steps_since_avg: int = 0
    steps_at_snapshot: int = 0
    snapshots: int = 0
    throttled: bool = False
    in_collective: bool = False
    collectives: int = 0
    exited: bool = False
    crashed: bool = False
    global_step: int = 0
    epoch_role: int | None = None
    last_epoch_fired: int = -1
    armed_eval: tuple[int, int] | None = None
    #: (schedule_id, epoch) of an ArmEpochEval: scored before that epoch's first step
    armed_epoch_eval: tuple[int, int] | None = None
    #: (tick, epoch) of each plan's start and end
    starts: list[tuple[int, int]] = field(default_factory=list)
    ends: list[tuple[int, int]] = field(default_factory=list)
    trained: list[tuple[int, int]] = field(default_factory=list)
    outbox: list[object] = field(default_factory=list)
    dropped_plans: int = 0
    #: at each round (SyncNow, RequestParams): (steps it weighs, batches trained so far)
    rounds_seen: list[tuple[int, int]] = field(default_factory=list)
    aggregated: list[m.EpochMetrics] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)
    saves: int = 0
    sessions: list[tuple[int, int]] = field(default_factory=list)
    #: (tick, speed): from that tick on, a batch takes ``speed`` ticks (a rank slowed
    #: mid-run, as a co-tenant or a throttled device does)
    slows_at: tuple[int, int] | None = None
    #: the tick the last batch ended, and each collective's wait since it (ticks)
    last_batch_end: int = 0
    waits: list[int] = field(default_factory=list)

    # ------------------------------------------------------------------ control
    def dispatch(self, msg: object) -> None:
        if isinstance(msg, (m.RequestParams, m.SyncNow)):
            self.rounds_seen.append((self.steps_since_avg, len(self.trained)))
        if isinstance(msg, m.RequestParams):
            self.steps_at_snapshot = self.steps_since_avg
            self.snapshots += 1
            self.outbox.append(m.SnapshotReady(self.rank))
        elif isinstance(msg, _InProcUpdate):
            self.steps_since_avg = max(self.steps_since_avg - self.steps_at_snapshot, 0)
            self.steps_at_snapshot = 0
            self.throttled = False
            if self.armed_eval is not None:
                sid, epoch = self.armed_eval
                self.armed_eval = None
                self.outbox.append(m.EvalResult(self.rank, sid, epoch, 0.5, 0.0))
        elif isinstance(msg, m.WireUpdate):
            if msg.next_plan is not None:
                self.dispatch(m.StartEpoch(msg.next_plan))
        elif isinstance(msg, m.SyncNow):
            self.in_collective = True
        elif isinstance(msg, m.StartEpoch):
            if self.pending_plan is not None:
                self.dropped_plans += 1
            self.pending_plan = msg.plan
        elif isinstance(msg, m.ExtendPartition):
            assert self.plan is not None or self.partition is not None
            epoch = self.plan.epoch if self.plan is not None else 0
            self.partition.extend(self._expand(epoch, msg.partition_offset, msg.partition_size))
        elif isinstance(msg, m.Throttle):
            self.throttled = True
        elif isinstance(msg, m.SetGlobalStep):
            self.global_step = msg.global_step
        elif isinstance(msg, m.Checkpoint):
            if msg.target_rank == self.rank:
                self.outbox.append(m.CheckpointResult(self.rank, msg.version, 1.0))
        elif isinstance(msg, m.ExecuteEvalCallback):
            if msg.target_rank == self.rank:
                self.outbox.append(m.EvalResult(self.rank, msg.schedule_id, msg.epoch, 0.9, 1.0))
        elif isinstance(msg, m.ArmConsensusEval):
            if msg.target_rank == self.rank:
                self.armed_eval = (msg.schedule_id, msg.epoch)
        elif isinstance(msg, m.ArmEpochEval):
            if msg.target_rank == self.rank:
                self.armed_epoch_eval = (msg.schedule_id, msg.epoch)
        elif isinstance(msg, m.RequestNewNcclId):
            self.outbox.append(m.NewNcclIdGenerated(self.rank, bytes([self.rank]) * 128))
        elif isinstance(msg, m.NewNcclSession):
            self.sessions.append((msg.new_rank, msg.new_world_size))
        elif isinstance(msg, m.SetEpochCallbackRole):
            self.epoch_role = msg.rank
        elif isinstance(msg, m.SaveConsensusModel):
            if msg.target_rank == self.rank:
                self.saves += 1
        elif isinstance(msg, (m.Shutdown, m.ShutdownWithSave)):
            self.exited = True
            self.throttled = False
            self.outbox.append(m.Exiting(self.rank))
        elif isinstance(msg, m.EpochAggregated):
            self.aggregated.append(msg.metrics)
        elif isinstance(msg, m.EvalBroadcast):
            self.evals.append((msg.epoch, msg.metric))

    def _expand(self, epoch: int, offset: int, size: int) -> list[int]:
        c = self.cfg
        return make_partition(offset, size, c.pick_space, epoch, c.seed, c.epoch_splits)

    def drain(self) -> None:
        while self.queue and not self.in_collective and not self.exited:
            self.dispatch(self.queue.popleft())

    # ------------------------------------------------------------------ training
    def _start_plan(self, plan: m.EpochPlan, t: int) -> None:
        self.plan = plan
        self.partition = self._expand(plan.epoch, plan.partition_offset, plan.partition_size)
        self.batch_idx = 0
        self.plan_loss = 0.0
        self.plan_started = t
        self.starts.append((t, plan.epoch))
        armed = self.armed_epoch_eval
        if armed is not None and plan.epoch >= armed[1]:
            self.armed_epoch_eval = None
            self.outbox.append(m.EvalResult(self.rank, armed[0], armed[1], 0.9, 1.0))
        if plan.epoch != self.last_epoch_fired:
            self.last_epoch_fired = plan.epoch
            if self.epoch_role == self.rank:
                self.outbox.append(m.EpochFnElapsed(self.rank, plan.epoch, 0.5))

    def _end_plan(self, t: int) -> None:
        assert self.plan is not None
        bs = self.cfg.batch_size
        n = len(self.partition) // bs
        elapsed = float(t - self.plan_started)
        self.ends.append((t, self.plan.epoch))
        self.outbox.append(
            m.MetricsMsg(
                rank=self.rank,
                epoch=self.plan.epoch,
                avg_loss=self.plan_loss / n if n else 0.0,
                batches_processed=n,
                epoch_ms=elapsed,
                samples_processed=n * bs,
                share_complete_ms=float(n * self.speed),
                compute_only_ms=float(n * self.speed),
                data_starve_ms=0.0,
            )
        )
        self.plan = None

    def step(self, t: int) -> None:
        if self.exited or self.crashed:
            return
        bs = self.cfg.batch_size
        if self.busy_until == t:
            self.busy_until = None
            assert self.plan is not None
            picks = self.partition[self.batch_idx * bs : (self.batch_idx + 1) * bs]
            self.trained += [(self.plan.epoch, p) for p in picks]
            self.batch_idx += 1
            self.local_step += 1
            self.steps_since_avg += 1
            loss = 1.0 / (1.0 + self.local_step)
            self.plan_loss += loss
            self.outbox.append(m.Batch(self.rank, float(self.speed), 0.0, self.local_step, loss))
            self.outbox.append(m.LrUpdate(self.rank, 0.1))
            self.last_batch_end = t
        if self.slows_at is not None and t >= self.slows_at[0]:
            self.speed = self.slows_at[1]
        if self.busy_until is not None:
            return  # control is read between batches, as the rank's loop does
        self.drain()
        if self.exited or self.in_collective or self.throttled or self.busy_until is not None:
            return
        if self.plan is not None and self.batch_idx >= len(self.partition) // bs:
            self._end_plan(t)
        if self.plan is None:
            # wait_for_epoch_plan: the pending slot first, then the queue.
            while self.pending_plan is None and self.queue and not self.in_collective:
                self.dispatch(self.queue.popleft())
                if self.exited or self.throttled:
                    return
            if self.pending_plan is None or self.in_collective:
                return
            plan, self.pending_plan = self.pending_plan, None
            self._start_plan(plan, t)
            if len(self.partition) // bs == 0:
                self._end_plan(t)
                return
        self.busy_until = t + self.speed


class Cluster:
    def __init__(
        self,
        cfg: CoordinatorConfig,
        speeds: Sequence[int],
        core: Coordinator | None = None,
    ) -> None:
        self.cfg = cfg
        self.core = core if core is not None else Coordinator(cfg)
        self.ranks = [SimRank(r, s, cfg) for r, s in enumerate(speeds)]
        self.t = 0
        self.rounds = 0
        self.sent: list[tuple[int | None, object]] = []
        self.metas: list[dict[str, object]] = []
        self.finished: Finished | None = None
        self.kill_at: dict[int, int] = {}
        self.heartbeat_every_ms = 1000

    @property
    def now(self) -> float:
        return self.t / 1000.0

    def deliver(self, outs: list[Out]) -> None:
        for o in outs:
            if isinstance(o, Send):
                self.sent.append((o.rank, o.msg))
                self.ranks[o.rank].queue.append(o.msg)
            elif isinstance(o, Broadcast):
                self.sent.append((None, o.msg))
                for rk in self.ranks:
                    rk.queue.append(o.msg)
            elif isinstance(o, WriteMeta):
                self.metas.append(dict(o.meta))
            elif isinstance(o, Finished):
                self.finished = o

    def _live(self) -> list[SimRank]:
        return [rk for rk in self.ranks if not rk.exited and not rk.crashed]

    def _resolve(self) -> None:
        live = self._live()
        # NCCL collective: completes once every live rank is inside it.
        if live and all(rk.in_collective for rk in live):
            for rk in live:
                rk.waits.append(self.t - rk.last_batch_end)
                rk.in_collective = False
                rk.throttled = False
                rk.steps_since_avg = 0
                rk.steps_at_snapshot = 0
                rk.local_step += 1
                rk.outbox.append(m.SyncAck(rk.rank, rk.local_step, 0.01, 1.0, 1.0))
                rk.collectives += 1
        # CPU round k completes once every live rank has snapshotted k times.
        if live and min(rk.snapshots for rk in live) > self.rounds:
            self.rounds += 1
            for rk in live:
                rk.queue.appendleft(_InProcUpdate(self.rounds))
                rk.drain() if not rk.in_collective else None
                rk.outbox.append(m.SyncAck(rk.rank, 0, 0.01, 1.0, 1.0))

    def run(self, limit_ms: int = 200_000) -> None:
        self.deliver(self.core.start(self.now))
        while self.finished is None or any(not rk.exited for rk in self._live()):
            self.t += 1
            if self.t > limit_ms:
                raise AssertionError(f"simulation did not finish: {self.core.state_summary()}")
            for r, at in self.kill_at.items():
                if at == self.t:
                    self.ranks[r].crashed = True
            for rk in self.ranks:
                rk.step(self.t)
            self._resolve()
            for rk in self.ranks:
                if rk.crashed:
                    rk.outbox.clear()
                    continue
                if self.t % self.heartbeat_every_ms == 0 and not rk.exited:
                    rk.outbox.append(m.Heartbeat(rk.rank, self.t))
                msgs, rk.outbox = rk.outbox, []
                for msg in msgs:
                    self.deliver(self.core.handle(rk.rank, msg, self.now))
            self.deliver(self.core.tick(self.now))

    # ------------------------------------------------------------------ checks
    def trained_by_epoch(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for rk in self.ranks:
            for e, p in rk.trained:
                out.setdefault(e, []).append(p)
        return out

    def expected_epoch(self, epoch: int) -> list[int]:
        c = self.cfg
        span = epoch_span(c.pick_space, epoch, c.seed, c.epoch_splits)
        return sorted(int(p) for p in span[: c.epoch_batches(epoch) * c.batch_size])

    def count_sent(self, kind: type) -> int:
        return sum(1 for _, msg in self.sent if isinstance(msg, kind))
