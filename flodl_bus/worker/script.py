"""A rank whose training loop is the user's own script (``flodl-bus up --script``).

A ``Job`` hands the bus its callbacks and the bus runs the loop (``RankLoop``). A script
that keeps its loop (gradient accumulation, several optimizers, its own schedule or mixed
precision) wraps it in a ``Rank`` instead::

    with flodl_bus.Rank(model, optimizer, data, batch_size=32, epochs=5) as rank:
        for epoch in rank.epochs():
            for x, y in rank.batches():
                loss = loss_fn(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                rank.step(loss)

The rank joins the run as ``flodl-bus worker`` does (its flags come from ``up``, in
``ENV_WORKER_ARGV``) and is set up by the same ``RankSession``; ``batches`` yields the
batches of the plans the coordinator sends, and ``step`` reports each and services the
control that came meanwhile (averaging, throttle, eval, checkpoint, stop) through the
same ``RankLoop`` pieces as a job's loop, so a script's run records and replays alike.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import torch
from torch import nn

from flodl_bus.exits import OK
from flodl_bus.job import (
    Job,
    JobError,
    TrainData,
    accuracy,
    describe_error,
    offer_script_job,
)
from flodl_bus.options import ConfigError
from flodl_bus.protocol import leaving
from flodl_bus.protocol.messages import EpochPlan
from flodl_bus.stop_signals import StopSignals
from flodl_bus.worker.loop import PlanTally, RankLoop, set_active
from flodl_bus.worker.options import ENV_WORKER_ARGV, PROG, check, parser
from flodl_bus.worker.rank import RankSession


def _worker_args(env: dict[str, str]) -> list[str]:
    raw = env.get(ENV_WORKER_ARGV)
    if raw is None:
        raise ConfigError(
            f"this script's flodl_bus.Rank is not in a run ({ENV_WORKER_ARGV} is unset): "
            "start it with `flodl-bus up --script SCRIPT [ARGS]`"
        )
    try:
        argv = json.loads(raw)
    except ValueError:
        argv = None
    if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
        raise ConfigError(f"{ENV_WORKER_ARGV} must be a JSON list of flodl-bus worker flags")
    return argv


def _leave_now(code: int) -> None:
    """At the script's end, after its own code (and its atexit handlers registered
    since), end the process with the rank's exit code without the interpreter's teardown
    of torch's and gloo's C++ state, as ``flodl-bus worker`` does (``flodl_bus.cli``):
    that teardown can hit a joinable thread and end a finished run in ``std::terminate``.
    An error the script left uncaught keeps the interpreter's own exit."""
    if getattr(sys, "last_value", None) is not None:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


class Rank:
    """This process as one rank of a run, around the script's own training loop.

    ``data`` is what the rank trains from: an ``ArrayDataset`` or any map-style
    ``torch.utils.data.Dataset``, the same on every rank; ``batches`` yields the batches
    of the picks the coordinator plans, on the rank's device. ``eval_fn(model,
    eval_data)`` scores the consensus when the coordinator asks (default: accuracy,
    when ``eval_data`` is given); ``checkpoint_fn(version, model)`` writes a checkpoint
    when it asks. The coordinator runs the script up to this constructor to learn the
    run's sizes, so code before it should build, not train.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        data: TrainData,
        *,
        batch_size: int,
        epochs: int,
        eval_data: TrainData | None = None,
        eval_fn: Callable[[nn.Module, Any], float] | None = accuracy,
        checkpoint_fn: Callable[[int, nn.Module], None] | None = None,
        target_metric: float | None = None,
        seed: int = 0,
        name: str | None = None,
    ) -> None:
        import __main__

        script = getattr(__main__, "__file__", None) or "script"
        self.job = Job(
            name=name or os.path.splitext(os.path.basename(script))[0],
            build_model=lambda: model,
            build_optimizer=lambda _model: optimizer,
            train_data=lambda: data,
            eval_data=None if eval_data is None else (lambda: eval_data),
            eval_fn=eval_fn if eval_data is not None else None,
            batch_size=batch_size,
            num_epochs=epochs,
            checkpoint_fn=checkpoint_fn,
            target_metric=target_metric,
            seed=seed,
        )
        # Read by the coordinator, the script ends here; in a rank it goes on.
        offer_script_job(self.job)
        self.model, self.optimizer = model, optimizer
        self._session: RankSession | None = None
        self._signals: StopSignals | None = None
        self._joined: Any = None
        #: the plan waiting to be trained: taken by ``epochs``, trained by ``batches``
        self._plan: EpochPlan | None = None
        self._in_epoch = False
        #: the batch ``batches`` yielded and ``step`` has not reported yet: its plan,
        #: when it was handed over, and how long making it took (ms)
        self._handed: tuple[PlanTally, float, float] | None = None
        #: the coordinator said stop (the only clean end of a rank)
        self.stopped = False
        #: what the bus's own code raised inside ``step``/``batches`` (the rank's
        #: failure; whatever else the script raises is the script's)
        self._ours: BaseException | None = None
        #: the rank's exit code once the ``with`` block ended (``flodl_bus.exits``)
        self.exit_code: int | None = None
        #: the epoch of the plan being trained
        self.epoch: int | None = None

    # ----------------------------------------------------------------- the run

    def __enter__(self) -> Rank:
        from flodl_bus.worker import cli

        self._signals = StopSignals().__enter__()
        try:
            args = parser().parse_args(_worker_args(dict(os.environ)))
            check(args)
        except ConfigError as exc:
            self._close_signals()
            raise SystemExit(f"{PROG}: {exc}") from None
        joined = cli.guarded(args, lambda: cli.join_run(args, self.job))
        if isinstance(joined, int):
            self._close_signals()
            raise SystemExit(joined)
        self._joined = joined
        session = RankSession(joined.job, joined.bus, joined.options, joined.factory, self._signals)
        refused = session.open()
        if refused is not None:
            cli.finish(joined, refused)
            self._close_signals()
            raise SystemExit(refused)
        self._session = session
        set_active(session.loop)
        self.model.train()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        from flodl_bus.worker import cli

        session, loop = self._session, self._loop
        assert session is not None
        set_active(None)
        clean = exc is None and self.stopped
        if exc is None and not self.stopped:
            loop.failure = leaving.reason(
                leaving.JOB_FAILED,
                "the script left its loop before the coordinator said stop: iterate "
                "rank.epochs() and rank.batches() to their end",
            )
        elif isinstance(exc, Exception):
            # The script's own code failing is the job's failure (the run stops), as a
            # job's loss_fn raising is; the bus's failing inside step is the rank's.
            theirs = exc is not self._ours and not isinstance(exc, JobError)
            loop.note_failure(
                JobError(f"the script raised {describe_error(exc)}") if theirs else exc
            )
        code: int | None = None
        try:
            loop.teardown(clean)
            if isinstance(exc, Exception) or loop.failure is not None:
                session.failed(exc if exc is not None else RuntimeError(loop.failure))
        finally:
            code = session.close(clean)
            cli.finish(self._joined, code)
            self._close_signals()
            self.exit_code = code
            atexit.register(_leave_now, code)
        if exc is None and code != OK:
            raise SystemExit(code)

    def _close_signals(self) -> None:
        if self._signals is not None:
            self._signals.__exit__(None, None, None)
            self._signals = None

    @property
    def _loop(self) -> RankLoop:
        if self._session is None:
            raise RuntimeError("use the Rank inside `with flodl_bus.Rank(...) as rank:`")
        return self._session.loop

    @property
    def rank(self) -> int:
        return self._loop.rank

    @property
    def world_size(self) -> int:
        assert self._session is not None
        return self._session.options.world_size

    @property
    def device(self) -> torch.device:
        """Where the model and the batches are (the rank's ``--device``)."""
        assert self._session is not None
        return self._session.device

    @property
    def global_step(self) -> int:
        """The run's global step as the coordinator counts it (every rank's batches),
        where a schedule of the run's progress reads its position."""
        return self._loop.control.lr_position

    # ------------------------------------------------------------ the batches

    def epochs(self) -> Iterator[int]:
        """Each epoch this rank trains in, once its first plan is here; ends when the
        coordinator says stop. Iterate ``batches`` inside."""
        while not self.stopped:
            plan = self._plan if self._plan is not None else self._next_plan()
            if plan is None:
                return
            self._plan, self.epoch = plan, plan.epoch
            self._in_epoch = True
            try:
                yield plan.epoch
            finally:
                self._in_epoch = False
            if self._plan is plan and not self.stopped:
                raise RuntimeError(
                    f"epoch {plan.epoch} ended without its batches: iterate rank.batches() "
                    "inside each epoch of rank.epochs()"
                )

    def batches(self) -> Iterator[Any]:
        """The batches to train, in the coordinator's plan, on the rank's device; call
        ``step`` once after each. Inside ``epochs``: the epoch's; alone: the run's."""
        loop = self._loop
        epoch = self._plan.epoch if self._in_epoch and self._plan is not None else None
        while not self.stopped:
            plan = self._plan if self._plan is not None else self._next_plan()
            if plan is None:
                return
            if epoch is not None and plan.epoch != epoch:
                self._plan = plan  # the next epoch's: ``epochs`` hands it over
                return
            self._plan, self.epoch = None, plan.epoch
            tally = self._run(loop.open_plan, plan)
            if tally is None:
                continue
            while loop.plan_left(tally):
                t0 = time.perf_counter()
                batch = self._run(loop.feed.get, tally.done)
                t1 = time.perf_counter()
                self._handed = (tally, t1, (t1 - t0) * 1000.0)
                yield batch
                if self._handed is not None:
                    raise RuntimeError("call rank.step(loss) once after each batch")
                if self.stopped:
                    return
            loop.close_plan(tally)

    @property
    def picks(self) -> list[int]:
        """The sample indices of the batch last yielded (for a script that loads its own)."""
        if self._handed is None:
            raise RuntimeError("rank.picks is the picks of a batch not yet stepped")
        picks = self._loop.picks_of(self._handed[0].done)
        assert picks is not None
        return picks

    def step(self, loss: torch.Tensor | float) -> None:
        """The batch last yielded is trained with ``loss``: report it (its loss and how
        long it took) and service the control that came meanwhile, which may average
        the parameters, throttle the rank until released, or stop it."""
        if self._handed is None:
            raise RuntimeError("rank.step() without a batch: call it once per batch")
        tally, handed_at, data_ms = self._handed
        self._handed = None
        loss_value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        compute_ms = (time.perf_counter() - handed_at) * 1000.0
        lr = float(self.optimizer.param_groups[0]["lr"]) if self.optimizer.param_groups else 0.0
        if self._run(self._loop.step_trained, tally, loss_value, data_ms, compute_ms, lr):
            self.stopped = True

    def _next_plan(self) -> EpochPlan | None:
        plan: EpochPlan | None = self._run(self._loop.next_plan)
        if plan is None:
            self.stopped = True
        return plan

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` of the bus's own; what it raises is marked as the rank's."""
        try:
            return fn(*args)
        except BaseException as exc:
            self._ours = exc
            raise
