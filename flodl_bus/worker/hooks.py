"""The job's result hooks on a rank: ``metrics_fn`` and ``eval_result_fn`` (flodl calls
them on its controller; here the job's code lives in the ranks, so the epoch-callback
role rank, the one that runs ``epoch_fn``, calls them as the broadcasts arrive), and the
sink of ``request_eval``/``request_checkpoint``."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from flodl_bus.job import Job, bind_intents, call_job
from flodl_bus.protocol.messages import (
    ControlMsg,
    EpochAggregated,
    EvalBroadcast,
    Intent,
    IntentKind,
    UpstreamMsg,
)

_log = structlog.get_logger("flodl_bus.worker")


class JobHooks:
    """Calls the job's result hooks for the control messages the loop dispatched."""

    def __init__(self, job: Job, rank: int, role: Callable[[], int | None]) -> None:
        self.job = job
        self.rank = rank
        #: the epoch-callback role as the core knows it now
        self.role = role

    @property
    def wanted(self) -> bool:
        return self.job.metrics_fn is not None or self.job.eval_result_fn is not None

    def dispatched(self, msg: ControlMsg) -> None:
        """After the core took ``msg``: the hook it triggers, if this rank holds the role.

        A hook that raises is logged and training goes on (flodl: a result callback's
        error never stops the run; the run's own metrics and record keep the values).
        """
        if self.role() != self.rank:
            return
        job = self.job
        try:
            if isinstance(msg, EpochAggregated) and job.metrics_fn is not None:
                call_job("metrics_fn", job.metrics_fn, msg.metrics)
            elif isinstance(msg, EvalBroadcast) and job.eval_result_fn is not None:
                call_job("eval_result_fn", job.eval_result_fn, msg.epoch, msg.metric)
        except Exception as exc:
            _log.error("job_hook_failed", rank=self.rank, error=str(exc))


def bind_intent_sink(rank: int, publish: Callable[[UpstreamMsg], None]) -> None:
    """Make ``request_eval``/``request_checkpoint`` on this thread (the training thread)
    publish an ``Intent`` of ``rank``."""

    def send(kind: IntentKind) -> None:
        publish(Intent(rank=rank, kind=kind))

    bind_intents(send)


def unbind_intent_sink() -> None:
    bind_intents(None)
