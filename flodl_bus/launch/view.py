"""What an observer of a run's streams knows about it (sans-IO: messages and ``now`` in).

``flodl-bus up`` does not ask the coordinator or the ranks how training goes: it reads
the same control plane they use (``up:<r>``, ``ctl:<r>``, ``ctl:all``) and folds every
message into this view. Everything shown (progress, the epoch table, the summary, the
plot) is derived here, so it is unit-testable without processes or Redis.

Syncs are read off the wire: a CPU averaging round is over when its ``Update`` (which
carries the round's version) reaches the ranks; an NCCL round is one ``SyncNow``,
broadcast on ``ctl:all`` or sent on each ``ctl:<r>``. The anchor (ElChe's window of the
slowest rank) is no field of any message; the launcher hands it in from the
coordinator's ``metrics.csv`` (``note_anchor``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from flodl_bus.protocol import leaving
from flodl_bus.protocol.messages import (
    Batch,
    DeclareDead,
    EpochAggregated,
    EpochMetrics,
    EvalBroadcast,
    EvalResult,
    Exiting,
    MetricsMsg,
    SaveReason,
    Shutdown,
    ShutdownWithSave,
    StartEpoch,
    SyncNow,
    WireUpdate,
)


@dataclass(frozen=True, slots=True)
class EpochRow:
    """One line of the epoch table."""

    epoch: int
    loss: float
    #: the eval metric scored for this epoch (None: not evaluated, or not yet)
    metric: float | None
    #: samples per second of each rank over the epoch
    throughput: tuple[float, ...]
    #: averaging rounds during this epoch, and in the whole run so far
    syncs: int
    syncs_total: int
    anchor: int | None
    epoch_s: float
    #: seconds since the launch when the aggregate was seen
    at: float
    #: batches the ranks skipped for a non-finite loss during this epoch
    skipped: int = 0


@dataclass(slots=True)
class RankView:
    batches: int = 0
    epoch: int = -1
    loss: float = math.nan
    sync_now: int = 0
    exited: bool = False
    #: (seconds since launch, loss) of every batch, for the plot
    losses: list[tuple[float, float]] = field(default_factory=list)
    #: the epochs of the plans sent it and not yet reported, oldest first: a world of
    #: one holds its next epoch's plan while it trains this one
    held: deque[int] = field(default_factory=deque)

    def planned(self, epoch: int) -> None:
        self.held.append(epoch)
        self.epoch = max(self.epoch, self.held[0])

    def reported(self, epoch: int) -> None:
        held = self.held
        while held and held[0] < epoch:
            held.popleft()  # a report this view did not see
        if held and held[0] == epoch:
            held.popleft()
        self.epoch = max(self.epoch, held[0] if held else epoch)


class RunView:
    """Folds a run's messages, in stream order per rank, into progress and results."""

    def __init__(
        self, world_size: int, started_at: float, *, eval_every: int | None = None
    ) -> None:
        self.world_size = world_size
        self.started_at = started_at
        #: the run's --eval-every (None: unknown), to know which rows an eval will fill;
        #: the last epoch's row always gets the final eval
        self.eval_every = eval_every
        #: the run's epochs, once known (``set_epochs``)
        self.num_epochs: int | None = None
        self.ranks = [RankView() for _ in range(world_size)]
        self.first_step_at: float | None = None
        self._version = 0
        self._anchors: dict[int, int | None] = {}
        self.metrics: dict[int, EpochMetrics] = {}
        #: eval metric by the number of epochs the scored model had trained: the eval
        #: tagged ``k`` runs when epoch ``k`` begins, on the consensus after epochs 0..k-1,
        #: so it belongs to the row of epoch ``k - 1`` (the final eval is tagged with the
        #: number of epochs)
        self.evals: dict[int, float] = {}
        #: the last eval metric in arrival order (see ``final_metric`` for the result)
        self.last_metric: float | None = None
        #: rows shown without their metric, whose eval came later (``take_late_evals``)
        self._late: list[tuple[int, float]] = []
        self.shutdown_seen = False
        self.save_requested = False
        self._syncs_at: dict[int, int] = {}
        self._rows_out: set[int] = set()
        #: rows that went out with their metric, or whose late metric was handed out
        self._shown_metric: set[int] = set()
        self._last_row_syncs = 0
        self._seen_at: dict[int, float] = {}
        #: one line per thing a person must know at once (a rank that failed or left,
        #: the run stopped early), for the console; ``take_notes`` hands them out once
        self.notes: list[str] = []
        self._notes_out = 0

    # ------------------------------------------------------------------ input
    def on_control(self, rank: int | None, msg: object, now: float) -> None:
        """A control entry read from ``ctl:<rank>`` (``rank`` None for ``ctl:all``)."""
        if isinstance(msg, SyncNow):
            if rank is None:
                for rv in self.ranks:
                    rv.sync_now += 1
            elif 0 <= rank < self.world_size:
                self.ranks[rank].sync_now += 1
        elif isinstance(msg, WireUpdate):
            self._version = max(self._version, msg.version)
            # Cadence hands the next chunk over with the Update ("atomic dispatch").
            if msg.next_plan is not None and rank is not None and 0 <= rank < self.world_size:
                self.ranks[rank].planned(msg.next_plan.epoch)
        elif isinstance(msg, StartEpoch) and rank is not None and 0 <= rank < self.world_size:
            self.ranks[rank].planned(msg.plan.epoch)
        elif isinstance(msg, ShutdownWithSave):
            self.save_requested = True
            if msg.reason is not SaveReason.GRACEFUL_SHUTDOWN:
                self.notes.append(f"run stopped by the coordinator: {msg.reason.snake}")
        elif isinstance(msg, DeclareDead) and rank is None and 0 <= msg.rank < self.world_size:
            if not self.ranks[msg.rank].exited:
                self.notes.append(f"rank {msg.rank} declared dead by the coordinator")
        elif isinstance(msg, EpochAggregated):
            e = msg.metrics.epoch
            self.metrics[e] = msg.metrics
            self._syncs_at[e] = self.syncs
            self._seen_at[e] = now - self.started_at
        elif isinstance(msg, EvalBroadcast):
            self._eval(msg.epoch, msg.metric)
        elif isinstance(msg, Shutdown):
            self.shutdown_seen = True

    def on_upstream(self, rank: int, msg: object, now: float) -> None:
        if not 0 <= rank < self.world_size:
            return
        rv = self.ranks[rank]
        if isinstance(msg, Batch):
            if self.first_step_at is None:
                self.first_step_at = now
            rv.batches += 1
            rv.loss = msg.batch_loss
            rv.losses.append((now - self.started_at, msg.batch_loss))
        elif isinstance(msg, MetricsMsg):
            rv.reported(msg.epoch)
        elif isinstance(msg, EvalResult):
            if msg.error is None:
                self._eval(msg.epoch, msg.metric)
            else:
                # Said on the console: a run whose final eval failed ends with metric "-",
                # and its cause was only in the rank's log.
                self.notes.append(
                    f"rank {rank}: the eval scheduled at epoch {msg.epoch} failed: {msg.error}"
                )
        elif isinstance(msg, Exiting):
            if msg.reason is not None and not rv.exited:
                if leaving.kind_of(msg.reason) == leaving.JOB_FAILED:
                    self.notes.append(f"rank {rank}: {leaving.detail_of(msg.reason)}")
                else:
                    self.notes.append(f"rank {rank} left: {msg.reason}")
            rv.exited = True

    def _eval(self, epoch: int, metric: float) -> None:
        if math.isfinite(metric):
            self.evals[epoch] = metric
            self.last_metric = metric
            if epoch - 1 in self._rows_out and epoch - 1 not in self._shown_metric:
                self._late.append((epoch - 1, metric))
                self._shown_metric.add(epoch - 1)

    def set_epochs(self, num_epochs: int | None) -> None:
        self.num_epochs = num_epochs

    @property
    def final_metric(self) -> float | None:
        """The metric of the latest-trained model scored (the highest eval tag), whatever
        order the evals arrived in: the run's result."""
        return self.evals[max(self.evals)] if self.evals else None

    def expects_eval(self, epoch: int) -> bool | None:
        """Whether an eval will score the model after ``epoch`` (None: unknown)."""
        if self.num_epochs is not None and epoch == self.num_epochs - 1:
            return True
        if self.eval_every is None:
            return None
        return self.eval_every > 0 and (epoch + 1) % self.eval_every == 0

    def take_late_evals(self) -> list[tuple[int, float]]:
        """(epoch, metric) of rows already shown with ``-`` whose eval has arrived since."""
        out, self._late = self._late, []
        return out

    def take_notes(self) -> list[str]:
        """The notes not handed out yet."""
        out = self.notes[self._notes_out :]
        self._notes_out = len(self.notes)
        return out

    def note_anchor(self, epoch: int, anchor: int | None) -> None:
        self._anchors[epoch] = anchor

    # ----------------------------------------------------------------- output
    @property
    def syncs(self) -> int:
        """Averaging rounds completed so far."""
        return max(self._version, max((r.sync_now for r in self.ranks), default=0))

    @property
    def skipped(self) -> int:
        """Batches skipped for a non-finite loss in the epochs aggregated so far: the
        coordinator's count (``EpochMetrics.per_rank_skipped``), the one metrics.csv has."""
        return sum(sum(m.per_rank_skipped) for m in self.metrics.values())

    @property
    def total_batches(self) -> int:
        return sum(r.batches for r in self.ranks)

    def time_to_first_step(self) -> float | None:
        return None if self.first_step_at is None else self.first_step_at - self.started_at

    def rows_pending(self) -> bool:
        return any(e not in self._rows_out for e in self.metrics)

    def rows_ready(self, final: bool = False) -> list[EpochRow]:
        """Epoch rows not shown yet, in epoch order.

        A row waits for its epoch's eval (the consensus is scored after the round that
        follows the epoch; async epochs overlap, so it may come after later epochs were
        aggregated) while one is due for it: until it comes, two later epochs are
        aggregated (an eval that failed), or the run ends. A row no eval is due for goes
        out at once. An eval that comes after its row went out is handed out by
        ``take_late_evals``.
        """
        out: list[EpochRow] = []
        for e in sorted(self.metrics):
            if e in self._rows_out:
                continue
            if self.is_last(e) and not final:
                break  # its rounds are counted at the run's end (see ``_row``)
            if e + 1 not in self.evals and not final:
                due = self.expects_eval(e)
                later = sum(1 for k in self.metrics if k > e)
                if due is None and later == 0:
                    break  # unknown schedule: wait for the next epoch at least
                if due and later < 2:
                    break
            out.append(self._row(e))
            self._rows_out.add(e)
            if e + 1 in self.evals:
                self._shown_metric.add(e)
        return out

    def is_last(self, epoch: int) -> bool:
        return self.num_epochs is not None and epoch == self.num_epochs - 1

    def _row(self, e: int) -> EpochRow:
        m = self.metrics[e]
        # The rounds of an epoch are those done by its aggregate; the last epoch also
        # takes the rounds after it (the final averaging), so its total is the run's,
        # as metrics.csv, TensorBoard, status and the dashboard count them.
        total = self.syncs if self.is_last(e) else self._syncs_at.get(e, self.syncs)
        syncs = total - self._last_row_syncs
        self._last_row_syncs = total
        return EpochRow(
            epoch=e,
            loss=m.avg_loss,
            metric=self.evals.get(e + 1),
            throughput=tuple(t * 1000.0 for t in m.per_rank_throughput),
            syncs=syncs,
            syncs_total=total,
            anchor=self._anchors.get(e),
            epoch_s=m.epoch_ms / 1000.0,
            at=self._seen_at.get(e, 0.0),
            skipped=sum(m.per_rank_skipped),
        )
