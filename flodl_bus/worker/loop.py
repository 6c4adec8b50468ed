"""The training thread: the blocking half of the rank state machine and the train loop.

``WorkerControl`` decides; this module owns the queue and the model. It feeds control
messages to the core (non-blocking between batches, blocking while throttled or idle),
publishes what the core returns, and trains the plans it is handed (reference §3.2-3.4).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog
import torch
from torch import nn

from flodl_bus.job import Job, JobError, TrainData, call_job
from flodl_bus.protocol import leaving
from flodl_bus.protocol.messages import (
    NONFINITE_SKIPPED_TAG,
    Batch,
    ControlMsg,
    EpochFnElapsed,
    EpochPlan,
    EvalResult,
    Exiting,
    LrUpdate,
    MetricsMsg,
    ResourceSample,
    UpstreamMsg,
)
from flodl_bus.worker.control import Dispatched, WorkerControl, acts_at_teardown
from flodl_bus.worker.cores import KeptCore
from flodl_bus.worker.feed import Feed, FeedOptions, make_feed
from flodl_bus.worker.inbox import Closed, Inbox
from flodl_bus.worker.resources import sample as sample_resources
from flodl_bus.worker.threads import ThreadTuner

_log = structlog.get_logger("flodl_bus.worker")

#: The loop whose plan is running on this thread, so ``record_scalar`` called from user
#: code (a loss function) lands in the right plan's metrics.
_active = threading.local()


def record_scalar(tag: str, value: float) -> None:
    """Add ``value`` to ``tag``'s accumulator of the plan running on this thread.

    The coordinator receives (sum, count) per tag in the plan's MetricsMsg and averages
    across ranks. Outside a running loop the value is dropped.
    """
    loop: RankLoop | None = getattr(_active, "loop", None)
    if loop is not None:
        loop.record_scalar(tag, value)


def set_active(loop: RankLoop | None) -> None:
    """Make ``loop`` the one ``record_scalar`` adds to on this thread (None: no loop)."""
    _active.loop = loop


class CoreObserver(Protocol):
    """Watches every call the loop makes into the core, in order (the rank's recorder,
    ``worker.recording``). ``before`` is called right before each dispatch, ``begin``
    right before every other core call (a step, a plan taken, a close: their records
    hold the state after, not before, and a step's is the training thread's hottest
    record), on the training thread; the other hooks right after it, with what it
    returned."""

    def before(self) -> None: ...

    def begin(self) -> None: ...

    def dispatched(
        self, msg: ControlMsg, out: Dispatched | None, raised: BaseException | None
    ) -> None: ...

    def planned(self, plan: EpochPlan) -> None: ...

    def stepped(
        self, args: tuple[float, float, float, float], out: tuple[Batch, LrUpdate | None]
    ) -> None: ...

    def closed(self, out: Dispatched) -> None: ...

    def dropped(self, msg: ControlMsg) -> None: ...


@dataclass
class PlanTally:
    """What a plan has trained so far, for its MetricsMsg at the end."""

    plan: EpochPlan
    #: ``time.perf_counter()`` when the plan began
    started: float
    done: int = 0
    finite_done: int = 0
    loss_sum: float = 0.0
    compute_ms: float = 0.0
    data_ms: float = 0.0

    def add(self, loss_value: float, data_ms: float, compute_ms: float) -> None:
        self.done += 1
        self.data_ms += data_ms
        self.compute_ms += compute_ms
        # A non-finite loss (a skipped batch) counts as trained but not in the average.
        if math.isfinite(loss_value):
            self.loss_sum += loss_value
            self.finite_done += 1


class RankLoop:
    def __init__(
        self,
        *,
        job: Job,
        control: WorkerControl,
        inbox: Inbox,
        publish: Callable[[UpstreamMsg], None],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_data: TrainData,
        feed: Feed | None = None,
        lr_scale: float = 1.0,
        base_lrs: Sequence[float] | None = None,
        planned_epochs: int | None = None,
        epoch_fn: Callable[[int], None] | None = None,
        final_snapshot: Callable[[], None] | None = None,
        observer: CoreObserver | None = None,
        failure_of: Callable[[], str | None] | None = None,
        on_dispatched: Callable[[ControlMsg], None] | None = None,
        threads: ThreadTuner | None = None,
        on_threads: Callable[[ThreadTuner], None] | None = None,
        kept_core: KeptCore | None = None,
    ) -> None:
        self.job = job
        self.control = control
        self.inbox = inbox
        self.publish = publish
        self.model = model
        self.optimizer = optimizer
        self.train_data = train_data
        #: where batches come from; by default made ahead off this thread (``worker.feed``)
        self.feed = (
            feed
            if feed is not None
            else make_feed(train_data, _device_of(model), FeedOptions(), seed=job.seed)
        )
        self.lr_scale = lr_scale
        #: the optimizer's own LR per param group, as built (before any resume loaded a
        #: scaled one): the base of a job without a schedule
        self.base_lrs = (
            [float(g["lr"]) for g in optimizer.param_groups] if base_lrs is None else list(base_lrs)
        )
        #: the run's global steps, where ``job.lr_schedule`` ends (the job's epochs when
        #: the run's are not known)
        self.planned_steps = job.planned_steps(planned_epochs or job.num_epochs, len(train_data))
        #: the LR of a job without a schedule: each group's own, scaled once, never reset
        self.own_lr: float | None = None
        if not job.schedules_lr:
            for group, base in zip(optimizer.param_groups, self.base_lrs, strict=False):
                group["lr"] = base * lr_scale
            self.own_lr = self.base_lrs[0] * lr_scale if self.base_lrs else 0.0
        self.epoch_fn = epoch_fn
        self.final_snapshot = final_snapshot
        self.observer = observer
        #: asked at teardown for a failure found outside the loop (the param plane's
        #: averaging thread): an ``Exiting`` reason, or None
        self.failure_of = failure_of
        #: told of every control message after the core took it (the job's result
        #: hooks, ``worker.hooks``)
        self.on_dispatched = on_dispatched
        #: sizes torch's threads over the first steps (``worker.threads``); None once
        #: settled, or where the count is the one asked for
        self.threads = threads if threads is not None and not threads.done else None
        #: told once the count is settled
        self.on_threads = on_threads
        #: the training thread's own core (``worker.cores``), taken once the rank trains
        #: at one intra-op thread; None: the policy is off
        self.kept_core = kept_core
        if kept_core is not None and self.threads is None and torch.get_num_threads() == 1:
            kept_core.apply()
        #: why the rank leaves mid-run (an ``Exiting`` reason, see ``protocol.leaving``);
        #: None while nothing failed
        self.failure: str | None = None
        self.rank = control.rank
        self._scalars: dict[str, list[float]] = {}
        self._nonfinite_skipped = 0
        #: the epoch whose callback last fired (``next_plan``)
        self._last_epoch_fired: int | None = None

    # ------------------------------------------------------------------ control

    def _dispatch(self, msg: ControlMsg) -> Dispatched:
        obs = self.observer
        if obs is None:
            out = self.control.dispatch(msg)
        else:
            obs.before()
            try:
                out = self.control.dispatch(msg)
            except BaseException as exc:
                obs.dispatched(msg, None, exc)
                raise
            obs.dispatched(msg, out, None)
        for line in out.logs:
            getattr(_log, line.level)(line.event, **line.fields)
        for up in out.upstream:
            self.publish(up)
        for up in out.upstream:
            if isinstance(up, EvalResult) and up.error is not None:
                # flodl's rule: a raising eval_fn is reported (EvalResult.error, which the
                # coordinator alerts on) and logged; training goes on without that score.
                what = up.error if up.error.startswith("eval_fn") else f"eval_fn raised {up.error}"
                _log.error("eval_failed", rank=self.rank, epoch=up.epoch, reason=what)
        if self.on_dispatched is not None:
            self.on_dispatched(msg)
        return out

    def service(self, msg: ControlMsg) -> bool:
        """Dispatch ``msg``; if it throttles the rank, block feeding the core until a
        release. True means stop."""
        out = self._dispatch(msg)
        while out.throttled and not out.stop:
            nxt = self.inbox.get()
            if nxt is None or isinstance(nxt, Closed):
                # Nothing can ever release us: treat the dead channel as a shutdown.
                if self.observer is not None:
                    self.observer.begin()
                out = self.control.channel_closed()
                if self.observer is not None:
                    self.observer.closed(out)
                return out.stop
            out = self._dispatch(nxt)
        return out.stop

    def handle_control(self) -> bool:
        """Dispatch every queued control message without blocking (unless one throttles
        the rank). True on shutdown."""
        inbox = self.inbox
        while True:
            msg = inbox.poll()
            if msg is None:
                return False
            if self.service(msg):
                return True

    def wait_for_epoch_plan(self) -> EpochPlan | None:
        """Block until the core holds a plan to train; everything read meanwhile is
        dispatched (peers may be waiting on us in a collective). None means shut down."""
        control = self.control
        while True:
            armed = control.eval_due()
            if armed is not None:
                # Before the take, as its record replays it. Made here, not read off a
                # stream: the recorder must not name the entry last taken as its origin
                # (one consumer: this thread).
                self.inbox.last_origin = None
                self._dispatch(armed)
            plan = control.take_pending_plan()
            if plan is not None:
                return plan
            msg = self.inbox.get()
            if msg is None or isinstance(msg, Closed) or self.service(msg):
                return None

    def drain_pending_shutdown(self) -> None:
        """Teardown: dispatch what ``acts_at_teardown`` says (a queued ShutdownWithSave
        writes the bundle), drop everything else. Never blocks."""
        while True:
            msg = self.inbox.poll()
            if msg is None:
                return
            if acts_at_teardown(msg):
                self._dispatch(msg)
                return
            if self.observer is not None:
                self.observer.dropped(msg)

    # ----------------------------------------------------------------- training

    def record_scalar(self, tag: str, value: float) -> None:
        acc = self._scalars.get(tag)
        if acc is None:
            self._scalars[tag] = [float(value), 1.0]
        else:
            acc[0] += float(value)
            acc[1] += 1.0

    def _drain_scalars(self) -> dict[str, tuple[float, int]]:
        out = {tag: (acc[0], int(acc[1])) for tag, acc in self._scalars.items()}
        self._scalars = {}
        return out

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # ------------------------------------------------------------ a plan's steps
    #
    # The pieces every training loop is made of, the job's (``run_epoch_plan``) and a
    # script's own (``worker.script``): open a plan, feed its picks, report each step,
    # close it with its metrics. Between steps the rank services its control messages.

    def open_plan(self, plan: EpochPlan) -> PlanTally | None:
        """Start training ``plan``; None when it holds no batch (its zero metrics are
        already sent: the coordinator still has to see the plan complete)."""
        control, obs = self.control, self.observer
        start = time.perf_counter()
        if obs is not None:
            obs.begin()
        control.begin_plan(plan)
        if obs is not None:
            obs.planned(plan)
        if self.kept_core is not None:
            # Threads started since (they inherit the kept core from this one) move away.
            self.kept_core.hold()
        if control.num_batches == 0:
            self.publish(
                _zero_metrics(
                    self.rank,
                    plan.epoch,
                    self._drain_scalars(),
                    sample_resources(_device_of(self.model)),
                )
            )
            return None
        self.feed.begin(self.picks_of)
        return PlanTally(plan, start)

    def picks_of(self, index: int) -> list[int] | None:
        """The picks of the running plan's batch ``index``; None past its end. Re-read at
        every call: ExtendPartition grows the plan mid-way."""
        control = self.control
        return control.batch_picks(index) if index < control.num_batches else None

    def plan_left(self, tally: PlanTally) -> bool:
        """Whether the plan has a batch left (re-read: ExtendPartition grows it)."""
        return tally.done < self.control.num_batches

    def step_trained(
        self, tally: PlanTally, loss_value: float, data_ms: float, compute_ms: float, lr: float
    ) -> bool:
        """One batch of the plan is trained: tell the core, send its Batch (and LR), then
        service what control came meanwhile. True means stop."""
        tally.add(loss_value, data_ms, compute_ms)
        if self.threads is not None:
            self._size_threads(self.threads, compute_ms + data_ms)
        control, obs, publish = self.control, self.observer, self.publish
        if obs is not None:
            obs.begin()
        batch_msg, lr_msg = control.step_done(loss_value, compute_ms, data_ms, lr)
        if obs is not None:
            obs.stepped((loss_value, compute_ms, data_ms, lr), (batch_msg, lr_msg))
        publish(batch_msg)
        if lr_msg is not None:
            publish(lr_msg)
        return self.handle_control()

    def _size_threads(self, tuner: ThreadTuner, step_ms: float) -> None:
        count = tuner.observe(step_ms)
        if count is not None:
            torch.set_num_threads(count)
        if tuner.done:
            self.threads = None
            _log.info(
                "torch_threads_sized",
                rank=self.rank,
                chosen=tuner.chosen,
                medians=tuner.medians,
                runoff=tuner.runoff,
            )
            if self.on_threads is not None:
                self.on_threads(tuner)
            if self.kept_core is not None and tuner.chosen == 1:
                self.kept_core.apply()

    def close_plan(self, tally: PlanTally) -> None:
        """The plan is trained: its MetricsMsg, which tells the coordinator it is done."""
        control = self.control
        n = control.num_batches
        self.publish(
            MetricsMsg(
                rank=self.rank,
                epoch=tally.plan.epoch,
                avg_loss=tally.loss_sum / tally.finite_done if tally.finite_done else math.nan,
                batches_processed=n,
                epoch_ms=(time.perf_counter() - tally.started) * 1000.0,
                samples_processed=n * control.batch_size,
                share_complete_ms=tally.compute_ms + tally.data_ms,
                compute_only_ms=tally.compute_ms,
                data_starve_ms=tally.data_ms,
                scalars=self._drain_scalars(),
                resources=sample_resources(_device_of(self.model)),
            )
        )

    def run_epoch_plan(self, plan: EpochPlan) -> bool:
        """Train one plan (an epoch share or a chunk) with the job's loss. True means
        shut down."""
        tally = self.open_plan(plan)
        if tally is None:
            return False
        job = self.job
        model, optimizer, feed = self.model, self.optimizer, self.feed
        clip = job.max_grad_norm
        model.train()
        _active.loop = self
        try:
            while self.plan_left(tally):
                t0 = time.perf_counter()
                batch = feed.get(tally.done)
                t1 = time.perf_counter()
                scheduled = job.lr(self.control.lr_position, self.planned_steps)
                if scheduled is None:
                    lr = self.own_lr if self.own_lr is not None else 0.0
                else:
                    lr = scheduled * self.lr_scale
                    self._set_lr(lr)
                optimizer.zero_grad(set_to_none=True)
                loss = call_job("loss_fn", job.loss_fn, model, batch)
                call_job("loss_fn's backward", loss.backward)
                # Read after backward is queued (on a GPU the wait is for the forward
                # only, the backward keeps the device busy) and before the step, so a
                # non-finite loss never reaches the parameters.
                loss_value = float(loss.detach())
                if math.isfinite(loss_value):
                    if clip is not None:
                        nn.utils.clip_grad_norm_(model.parameters(), clip)
                    optimizer.step()
                else:
                    self._nonfinite(loss_value, plan, tally.done)
                t2 = time.perf_counter()
                if self.step_trained(tally, loss_value, (t1 - t0) * 1000.0, (t2 - t1) * 1000.0, lr):
                    return True
        finally:
            _active.loop = None
        self.close_plan(tally)
        return False

    def _nonfinite(self, loss_value: float, plan: EpochPlan, index: int) -> None:
        """A batch's loss is NaN or infinite: stop (a job failure) or skip it, as the
        job says. A skipped batch takes no optimizer step; it is still reported (its
        samples were seen), with its loss, which the coordinator leaves out of averages."""
        where = f"epoch {plan.epoch}, batch {index} of the plan at {plan.partition_offset}"
        if self.job.on_nonfinite_loss == "stop":
            raise JobError(
                f"loss_fn returned a non-finite loss ({loss_value}) at {where}; "
                'set Job(on_nonfinite_loss="skip") to skip such batches'
            )
        self.optimizer.zero_grad(set_to_none=True)
        self._nonfinite_skipped += 1
        self.record_scalar(NONFINITE_SKIPPED_TAG, 1.0)
        if self._nonfinite_skipped & (self._nonfinite_skipped - 1) == 0:
            # 1st, 2nd, 4th, 8th...: a run of bad batches is visible without a line each.
            _log.warning(
                "nonfinite_loss_skipped",
                rank=self.rank,
                loss=loss_value,
                at=where,
                skipped_total=self._nonfinite_skipped,
            )

    def _fire_epoch_fn(self, epoch: int) -> None:
        if self.epoch_fn is None or self.control.epoch_callback_role != self.rank:
            return
        start = time.perf_counter()
        call_job("epoch_fn", self.epoch_fn, epoch)
        self.publish(
            EpochFnElapsed(
                rank=self.rank, epoch=epoch, elapsed_ms=(time.perf_counter() - start) * 1000.0
            )
        )

    def next_plan(self) -> EpochPlan | None:
        """The next plan to train, once the core holds one; the epoch callback fires at
        each epoch change (once per transition, not per chunk). None means shut down."""
        plan = self.wait_for_epoch_plan()
        if plan is None:
            return None
        if plan.epoch != self._last_epoch_fired:
            self._last_epoch_fired = plan.epoch
            self._fire_epoch_fn(plan.epoch)
        return plan

    def note_failure(self, exc: BaseException) -> None:
        """Why the rank leaves, from what its training raised: the job's (or script's)
        own code is a job failure, which stops the run; anything else is the rank's."""
        if isinstance(exc, JobError):
            self.failure = leaving.reason(leaving.JOB_FAILED, exc.line)
        else:
            self.failure = leaving.reason(
                leaving.RANK_FAILED, f"{type(exc).__name__}: {exc}" if str(exc) else repr(exc)
            )

    def run_until_shutdown(self) -> bool:
        """The rank's main loop (reference §3.2). True on a clean completion, the only
        case that reports Exiting; an exception propagates after the teardown."""
        clean = False
        try:
            while (plan := self.next_plan()) is not None:
                if self.run_epoch_plan(plan):
                    break
            clean = True
        except Exception as exc:
            self.note_failure(exc)
            raise
        finally:
            self.teardown(clean)
        return clean

    def teardown(self, clean: bool) -> None:
        """The rank's last acts, whatever ended its training: a queued save is written,
        an unclean exit aborts the collectives peers may be parked in, and ``Exiting``
        says upstream why the rank leaves (nothing when it was cut short otherwise)."""
        try:
            self.drain_pending_shutdown()
        except Exception:
            _log.exception("teardown_drain_failed", rank=self.rank)
        if not clean:
            try:
                self.control.params.abort()
            except Exception:
                _log.exception("teardown_abort_failed", rank=self.rank)
        try:
            self.feed.close()
        except Exception:
            _log.exception("feed_close_failed", rank=self.rank)
        if self.final_snapshot is not None:
            try:
                self.final_snapshot()
            except Exception:
                _log.exception("final_snapshot_failed", rank=self.rank)
        if self.failure is None and self.failure_of is not None:
            self.failure = self.failure_of()
        if self.failure is not None:
            # Said upstream so the coordinator acts now (stops the run on a job
            # failure, declares the rank dead otherwise), not at a heartbeat timeout.
            self.publish(Exiting(rank=self.rank, reason=self.failure))
        elif clean:
            self.publish(Exiting(rank=self.rank))


def _device_of(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _zero_metrics(
    rank: int,
    epoch: int,
    scalars: dict[str, tuple[float, int]],
    resources: ResourceSample | None = None,
) -> MetricsMsg:
    return MetricsMsg(
        rank=rank,
        epoch=epoch,
        avg_loss=0.0,
        batches_processed=0,
        epoch_ms=0.0,
        samples_processed=0,
        share_complete_ms=0.0,
        compute_only_ms=0.0,
        data_starve_ms=0.0,
        scalars=scalars,
        resources=resources,
    )
