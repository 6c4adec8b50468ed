"""One rank, assembled: a job's model and data, the control core, the loop, the threads."""

from __future__ import annotations

import gc
import os
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch
from torch import nn

from flodl_bus.bus.api import RankBus
from flodl_bus.exits import CONFIG, FAILED, OK, STOPPED, by_signal
from flodl_bus.job import Job, JobError, call_job, check_train_data
from flodl_bus.params.port import ParamPort
from flodl_bus.params.user_group import UserGroup, UserGroupError
from flodl_bus.partition import SHUFFLE_BASE_SEED
from flodl_bus.protocol import leaving
from flodl_bus.protocol.messages import ControlMsg, Exiting, UpstreamMsg
from flodl_bus.stop_signals import StopSignals, signal_name
from flodl_bus.worker import cores, thread_stats
from flodl_bus.worker.control import WorkerControl
from flodl_bus.worker.cores import KeptCore
from flodl_bus.worker.feed import FeedOptions, make_feed
from flodl_bus.worker.hooks import JobHooks, bind_intent_sink, unbind_intent_sink
from flodl_bus.worker.host import set_rank_env, torch_threads, tunes_threads, usable_cores
from flodl_bus.worker.inbox import Inbox
from flodl_bus.worker.local_params import LocalParams
from flodl_bus.worker.loop import RankLoop
from flodl_bus.worker.model_port import (
    CheckpointFn,
    ConsensusSource,
    TorchModelPort,
    checkpoint_to,
)
from flodl_bus.worker.ports import ModelPort
from flodl_bus.worker.resume import restore_model, restore_rank_state, save_rank_state
from flodl_bus.worker.runtime import RankRuntime, RuntimeConfig, heartbeats_meanwhile
from flodl_bus.worker.threads import ThreadTuner

#: Builds the param plane for a rank: (model, inject into the control queue, publish).
ParamsFactory = Callable[
    [nn.Module, Callable[[ControlMsg], None], Callable[[UpstreamMsg], None]], ParamPort
]


#: Builds the rank's ``UserGroup`` (torch.distributed's default group for the job's code).
UserGroupFactory = Callable[[], UserGroup]

#: What torch says when a default group is initialized a second time.
_TWICE = "default process group twice"

#: The rank stopped in order because the coordinator fell silent (reference §3.12).
EXIT_COORDINATOR_LOST = STOPPED


@dataclass(frozen=True)
class RankOptions:
    world_size: int = 1
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    save_path: str | None = None
    shuffle_seed: int = SHUFFLE_BASE_SEED
    epoch_splits: int = 1
    #: LR multiplier on top of the job's schedule (flodl's linear scaling is
    #: ``1 + (world_size - 1) * ratio``; the job's schedule is used as given by default)
    lr_scale: float = 1.0
    #: the run's epochs (the coordinator's ``--epochs``), which sizes ``job.lr_schedule``;
    #: None: the job's own
    epochs: int | None = None
    #: the run's record directory (``runs/<run>``): every dispatch of this rank goes to
    #: ``<record_dir>/rank<r>.jsonl`` (None: not recorded)
    record_dir: str | None = None
    #: extra fields of the record's header (run id, mode, job...)
    record_header: Mapping[str, Any] = field(default_factory=dict)
    #: where the model and batches live: "cpu", "cuda" or "cuda:N"
    device: str = "cpu"
    #: says a line to the rank's console (its learning rate at the start); None: silent
    announce: Callable[[str], None] | None = None
    #: how batches are made (prefetch, data on the device, loader workers); None: from
    #: the environment (``FeedOptions.from_env``)
    feed: FeedOptions | None = None
    #: torch threads of this rank; None: its share of the host (``worker.host``)
    threads: int | None = None
    #: a CPU rank at its default share sizes its threads to the work over its first
    #: steps (``worker.threads``); False keeps the share (lockstep: a repeatable run)
    tune_threads: bool = True
    #: the save stem this run resumes from: the rank loads the consensus from
    #: ``<stem>.model.pt`` and its optimizer, outer optimizer and random state from
    #: ``<stem>.rank<r>.state.pt``; one that does not fit exits ``CONFIG``
    resume: str | None = None
    #: a plan waits for the running round's Update (``WorkerControl``; cpu-cadence)
    plans_wait_for_update: bool = False
    #: forms torch.distributed's default group before the job's code runs, re-formed
    #: with the averaging session after a death (``--user-group``); None: the job's own
    user_group: UserGroupFactory | None = None


def reset_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Forget every moment and step count, as a fresh optimizer of the same settings
    (its param groups, LRs included, stay): torch re-creates the state at the next step."""
    optimizer.state.clear()


def _bound_epoch_fn(job: Job, model: nn.Module) -> Callable[[int], None] | None:
    user_fn = job.epoch_fn
    if user_fn is None:
        return None
    return lambda epoch: user_fn(epoch, model)


def _checkpoint_fn(job: Job, save_path: str | None) -> CheckpointFn | None:
    """The job's ``checkpoint_fn`` (what it raises names it), else the default writer
    under ``--save-path``, else none (a Checkpoint sent here reports the missing fn)."""
    user_fn = job.checkpoint_fn
    if user_fn is not None:
        return lambda version, model: call_job("checkpoint_fn", user_fn, version, model)
    return checkpoint_to(save_path) if save_path else None


def _kept_core(device: torch.device) -> KeptCore | None:
    """``FLODL_KEEP_CORE=1`` on a CPU rank of a host with cores to spare: its training
    thread's own core (``worker.cores``)."""
    if device.type != "cpu" or not cores.wanted(os.environ):
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    try:
        usable = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return None
    chosen = cores.plan(usable, local_rank, local_world)
    log = structlog.get_logger("flodl_bus.worker")
    if chosen is None:
        log.info("kept_core_skipped", cores=len(usable), local_world=local_world)
        return None
    log.info("kept_core_planned", core=chosen.kept, away=len(chosen.away))
    return KeptCore(chosen)


def _threads_said(rank: int, announce: Callable[[str], None]) -> Callable[[ThreadTuner], None]:
    return lambda tuner: announce(f"rank {rank}: {tuner.describe()}")


def run_rank(
    job: Job,
    bus: RankBus,
    options: RankOptions,
    params_factory: ParamsFactory | None = None,
    stop: StopSignals | None = None,
) -> int:
    """Train ``job`` as ``bus.rank`` until the coordinator says stop.

    Exit code (``flodl_bus.exits``): 0 on a clean completion (Exiting sent);
    ``EXIT_COORDINATOR_LOST`` when the liveness escape hatch stopped the rank (an orderly
    teardown, but the run is lost); 1 when training failed; 128 + N when signal N
    (``stop``) made the rank leave mid-run (it said so upstream first).
    """
    session = RankSession(job, bus, options, params_factory, stop)
    refused = session.open()
    if refused is not None:
        return refused
    clean = False
    try:
        clean = session.loop.run_until_shutdown()
    except Exception as exc:
        # The loop already tore down in order and said why upstream (``Exiting`` with
        # ``loop.failure``); one line here, the traceback only in the record and at debug.
        session.failed(exc)
    finally:
        code = session.close(clean)
    return code


class RankSession:
    """One rank between its setup and its exit code; who trains in between is the
    caller's: the job's loop (``run_rank``) or a script's own (``worker.script``).

    ``open`` builds the model, the param plane, the core, the loop and the threads;
    ``close`` tears them down in order and says the exit code (``run_rank``'s).
    """

    def __init__(
        self,
        job: Job,
        bus: RankBus,
        options: RankOptions,
        params_factory: ParamsFactory | None = None,
        stop: StopSignals | None = None,
    ) -> None:
        if params_factory is None and options.world_size != 1:
            raise ValueError(
                "a world of more than one rank needs a param plane; pass params_factory "
                "(LocalParams only averages a world of one)"
            )
        self.job = job
        self.bus = bus
        self.options = options
        self.params_factory = params_factory
        self.stop = stop
        self.rank = bus.rank
        self.runtimes: list[RankRuntime] = []
        self.recording: Any = None
        self.user_group: UserGroup | None = None
        #: the training thread's counters once the rank is set up (``thread_stats``)
        self._trained_from: thread_stats.ThreadSample | None = None
        if stop is not None:
            stop.call_on_stop(self._on_stop)

    def _on_stop(self, signum: int, _nth: int) -> None:
        # Before the runtime runs, the signal is only noted: it is acted on right after
        # ``runtime.start`` (building the model is bounded; the record must be closed).
        for rt in self.runtimes:
            rt.leave(signal_name(signum))

    def open(self) -> int | None:
        """Set the rank up and start its threads; an exit code when it cannot start (the
        job's builder raised, a resume that does not fit), said upstream already."""
        # Heard from while it builds: the coordinator's liveness clock runs from the
        # world's start, and the default group's rendezvous waits for the slowest peer.
        with heartbeats_meanwhile(self.bus, self.options.runtime.heartbeat_interval):
            return self._open()

    def _open(self) -> int | None:
        job, bus, options, rank = self.job, self.bus, self.options, self.rank
        # Before any of the job's code runs: it may read them (torchrun's convention).
        set_rank_env(rank, options.world_size)
        threads = options.threads or torch_threads(os.environ, usable_cores())
        torch.set_num_threads(threads)
        feed_options = options.feed if options.feed is not None else FeedOptions.from_env()
        torch.manual_seed(job.seed)
        device = torch.device(options.device)
        if device.type == "cuda":
            # NCCL binds a communicator to the current device; set it before any group forms.
            torch.cuda.set_device(device)
        if options.user_group is not None:
            # Before the job's code: its build_model may already use the group.
            try:
                user_group = options.user_group()
                user_group.form(rank, options.world_size)
            except UserGroupError as exc:
                return _refused(bus, rank, f"--user-group: {exc}")
            self.user_group = user_group
        try:
            model = call_job("build_model", job.build_model).to(device)
            optimizer = call_job("build_optimizer", job.build_optimizer, model)
            # As built: a resume below loads the saved (already scaled) LR into the groups.
            base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
            train_data = check_train_data(call_job("train_data", job.train_data))
            eval_data = call_job("eval_data", job.eval_data) if job.eval_data is not None else None
            lr_said = _lr_said(job, base_lrs, options, len(train_data))
        except JobError as exc:
            self._close_user_group()
            return _failed_before_start(bus, rank, self._explained(exc))
        if options.resume is not None:
            # Before the param plane exists: it may take the model's values as they are.
            try:
                restore_model(options.resume, model)
            except ValueError as exc:
                self._close_user_group()
                return _refused(bus, rank, f"--resume: {exc}")

        recording = None
        if options.record_dir is not None:
            from flodl_bus.worker.recording import RankRecording

            recording = RankRecording(options.record_dir, rank)
            bus = recording.bus(bus)
        self.recording = recording

        inbox = Inbox()
        inbox.before_wait = getattr(bus, "hurry", None)
        if self.params_factory is None:
            params: ParamPort = LocalParams(model, rank=rank, inject=inbox.put, publish=bus.publish)
        else:
            params = self.params_factory(model, inbox.put, bus.publish)
        if hasattr(params, "reset_inner"):
            # DiLoCo: an outer optimizer that resets the inner one does it after each
            # adopted consensus; the plane owns the round, the rank owns the optimizer.
            params.reset_inner = lambda: reset_optimizer_state(optimizer)
        if options.resume is not None:
            try:
                restore_rank_state(options.resume, rank, optimizer, params)
            except ValueError as exc:
                close_params = getattr(params, "close", None)
                if callable(close_params):
                    close_params()
                self._close_user_group()
                return _refused(bus, rank, f"--resume: {exc}")
        self.raw_params = params
        model_port: ModelPort = TorchModelPort(
            rank=rank,
            model=model,
            optimizer=optimizer,
            eval_fn=job.eval_fn,
            eval_data=eval_data,
            checkpoint_fn=_checkpoint_fn(job, options.save_path),
            save_path=options.save_path,
            consensus=params if isinstance(params, ConsensusSource) else None,
            params=params,
            writer_role=lambda: control.epoch_callback_role,
        )
        clock: Callable[[], float] = time.perf_counter
        if recording is not None:
            # Recording wraps the ports; the core is the plain one (replay drives another).
            recorded_model = recording.model(model_port)
            model_port = recorded_model
            recording.header(
                **dict(options.record_header),
                world_size=options.world_size,
                batch_size=job.batch_size,
                pick_space=len(train_data),
                seed=options.shuffle_seed,
                splits=options.epoch_splits,
                model=recorded_model.capabilities(),
                lr=lr_said,
                plans_wait_for_update=options.plans_wait_for_update,
            )
            params = recording.params(params)
            clock = recording.clock(clock)
        self.params = params
        control = WorkerControl(
            rank=rank,
            params=params,
            batch_size=job.batch_size,
            pick_space=len(train_data),
            clock=clock,
            model=model_port,
            seed=options.shuffle_seed,
            splits=options.epoch_splits,
            plans_wait_for_update=options.plans_wait_for_update,
        )
        observer = None if recording is None else recording.observer(control, inbox)
        feed = make_feed(train_data, device, feed_options, seed=job.seed + rank)
        hooks = JobHooks(job, rank, lambda: control.epoch_callback_role)
        self.model, self.optimizer, self.device = model, optimizer, device
        self.loop = RankLoop(
            job=job,
            control=control,
            inbox=inbox,
            publish=bus.publish,
            model=model,
            optimizer=optimizer,
            train_data=train_data,
            feed=feed,
            lr_scale=options.lr_scale,
            base_lrs=base_lrs,
            planned_epochs=options.epochs,
            epoch_fn=_bound_epoch_fn(job, model),
            observer=observer,
            # The cpu averaging thread's failure (no caller to raise to); read at teardown.
            failure_of=lambda: getattr(params, "failure", None),
            on_dispatched=hooks.dispatched if hooks.wanted else None,
            threads=self._thread_tuner(threads, device),
            on_threads=None if options.announce is None else _threads_said(rank, options.announce),
            kept_core=_kept_core(device),
        )
        runtime = RankRuntime(
            bus=bus,
            inbox=inbox,
            params=params,
            world_size=options.world_size,
            config=options.runtime,
            # After the averaging group's: the default group follows it over the survivors.
            on_session=None if self.user_group is None else self.user_group.reform,
            on_offered=getattr(self.raw_params, "session_offered", None),
        )
        if options.announce is not None:
            options.announce(_lr_line(rank, lr_said))
        runtime.start()
        self.runtime = runtime
        self.runtimes.append(runtime)
        if self.stop is not None and self.stop.signum is not None:
            runtime.leave(signal_name(self.stop.signum))
        # The model, the data and the imports are built: out of the collector's view with
        # them, or each full collection stalls the training and reader threads for ms
        # (``bus.stream_ops.settle_heap``).
        gc.freeze()
        # The job's request_eval/request_checkpoint, called on this (the training) thread.
        bind_intent_sink(rank, bus.publish)
        self._trained_from = thread_stats.sample()
        return None

    def _thread_tuner(self, share: int, device: torch.device) -> ThreadTuner | None:
        """A CPU rank at its default share sizes its threads to the work; a count asked
        for (``threads``, ``FLODL_NUM_THREADS``, a launcher's own split) is kept, and so
        is a lockstep run's (its steps must not depend on timing)."""
        options = self.options
        if (
            options.threads is not None
            or not options.tune_threads
            or device.type != "cpu"
            or not tunes_threads(os.environ)
            or share <= 1
        ):
            return None
        return ThreadTuner(share)

    def _explained(self, exc: JobError) -> JobError:
        """A job that makes the default group itself, beside the one the bus made: the
        fix, in the same line (torch only says it was initialized twice)."""
        if self.user_group is None or _TWICE not in str(exc.__cause__ or ""):
            return exc
        better = JobError(
            f"{exc.line} (the bus set up torch.distributed's default group before the "
            "job's code ran: drop the job's init_process_group or guard it with "
            "dist.is_initialized(), or run with --user-group false)"
        )
        better.__cause__ = exc.__cause__
        return better

    def _close_user_group(self) -> None:
        if self.user_group is not None:
            self.user_group.close()

    def failed(self, exc: BaseException) -> None:
        """Training raised (after the loop's teardown): one console line, the traceback
        in the record."""
        _log_failure(self.rank, self.loop.failure or repr(exc), exc, self.recording)

    def close(self, clean: bool) -> int:
        """Tear the rank down after its loop's own teardown; the exit code."""
        # Before the teardown's joins: how often the training thread stopped while it ran.
        trained = thread_stats.since(self._trained_from, thread_stats.sample())
        options, rank, runtime, loop = self.options, self.rank, self.runtime, self.loop
        stop, recording = self.stop, self.recording
        unbind_intent_sink()
        # Back into the collector's view: what is frozen is never collected, so a
        # process group caught in a cycle would outlive the interpreter and gloo's
        # threads would end the process in std::terminate (exit -6) at teardown.
        gc.unfreeze()
        # The param plane first: its averaging thread may still publish a round's
        # SyncAck, which needs the bus the runtime closes.
        close_params = getattr(self.params, "close", None)
        if callable(close_params):
            close_params()
        runtime.close()
        # After the runtime: its session thread (which re-forms the group) has stopped.
        if self.user_group is not None:
            self.user_group.close()
        else:
            _close_users_process_group(rank)
        if stop is not None and runtime.left is not None:
            assert stop.signum is not None
            code = by_signal(stop.signum)
        elif runtime.declared_dead.is_set():
            code = STOPPED
        elif not clean or loop.failure is not None:
            if clean:  # a failure found off the training thread (an averaging round)
                _log_failure(rank, loop.failure or "", None, recording)
            code = FAILED
        else:
            code = EXIT_COORDINATOR_LOST if runtime.coordinator_lost.is_set() else OK
        if code == OK and runtime.shutdown_seen and options.save_path is not None:
            # The run ended in order beside its final consensus save: what a resumed
            # run needs besides that model (the rank is idle, so this is its state at
            # the saved consensus).
            try:
                save_rank_state(options.save_path, rank, self.optimizer, self.raw_params)
            except Exception as exc:
                structlog.get_logger("flodl_bus.worker").error(
                    "rank_state_not_saved", rank=rank, error=repr(exc)
                )
        if recording is not None:
            # The closing line: a record without it was cut short (a kill, a crash).
            recording.event(
                "end",
                exit_code=code,
                clean=clean,
                left=runtime.left,
                failure=loop.failure,
                training_thread=trained,
            )
            recording.close()
        return code


def _log_failure(rank: int, why: str, exc: BaseException | None, recording: Any) -> None:
    """One console line for a rank that failed; its traceback goes to the rank's record
    (``rank_failed`` event) and, at ``--log-level debug``, to the console."""
    log = structlog.get_logger("flodl_bus.worker")
    log.error("rank_failed", rank=rank, reason=why)
    if exc is None:
        return
    log.debug("rank_failed_traceback", rank=rank, exc_info=exc)
    if recording is not None:
        text = "".join(traceback.format_exception(exc))
        recording.event("rank_failed", reason=why, traceback=text)


def _refused(bus: RankBus, rank: int, line: str) -> int:
    """The rank cannot start as set up (a resume that does not fit): one line, upstream
    too (the coordinator stops the run without a save), and the config exit code."""
    structlog.get_logger("flodl_bus.worker").error("rank_refused", rank=rank, reason=line)
    try:
        bus.publish(Exiting(rank=rank, reason=leaving.reason(leaving.CONFIG_ERROR, line)))
        if not bus.flush(5.0):
            structlog.get_logger("flodl_bus.worker").error("upstream_flush_timeout", rank=rank)
    finally:
        bus.close()
    return CONFIG


def _failed_before_start(bus: RankBus, rank: int, exc: JobError) -> int:
    """A builder raised before the rank had a loop: say so upstream and stop.

    No record is written (nothing was dispatched to replay); the coordinator's record
    holds the ``Exiting`` with the reason, and it stops the run on it.
    """
    why = leaving.reason(leaving.JOB_FAILED, exc.line)
    _log_failure(rank, why, exc, None)
    try:
        bus.publish(Exiting(rank=rank, reason=why))
        if not bus.flush(5.0):
            structlog.get_logger("flodl_bus.worker").error("upstream_flush_timeout", rank=rank)
    finally:
        bus.close()
    return FAILED


def _lr_said(
    job: Job, base_lrs: Sequence[float], options: RankOptions, train_size: int
) -> dict[str, Any]:
    """Where the rank's first learning rate comes from and what it is after scaling."""
    planned = job.planned_steps(options.epochs or job.num_epochs, train_size)
    scheduled = job.lr(0, planned)
    base = scheduled if scheduled is not None else (base_lrs[0] if base_lrs else 0.0)
    return {
        "source": "job" if scheduled is not None else "optimizer",
        "base": base,
        "scale": options.lr_scale,
        "first": base * options.lr_scale,
        "world_size": options.world_size,
    }


def _lr_line(rank: int, lr: Mapping[str, Any]) -> str:
    source = "the job's lr_at/lr_schedule" if lr["source"] == "job" else "the optimizer's own LR"
    line = f"rank {rank}: learning rate {lr['first']:.6g} ({source} {lr['base']:.6g}"
    if lr["scale"] != 1.0:
        line += (
            f" x {lr['scale']:.6g}, flodl's linear scaling over {lr['world_size']} ranks;"
            " --lr-scale-ratio 0 trains at the job's LR"
        )
    return line + ")"


def _close_users_process_group(rank: int) -> None:
    """The job's own ``torch.distributed`` default group (``init_process_group`` on the
    launcher's MASTER_ADDR/MASTER_PORT), destroyed before the process ends: a gloo group
    alive at interpreter teardown ends the process in ``std::terminate``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.destroy_process_group()
    except Exception as exc:  # its peers may be gone: the run's result stands
        structlog.get_logger("flodl_bus.worker").warning(
            "user_process_group_not_closed", rank=rank, error=repr(exc)[:200]
        )
