"""The job's result hooks and intents on a rank (``worker.hooks``)."""

from __future__ import annotations

import dataclasses

import pytest
from structlog.testing import capture_logs

from flodl_bus.examples import digits
from flodl_bus.job import request_checkpoint, request_eval
from flodl_bus.protocol.messages import (
    EpochAggregated,
    EpochMetrics,
    EvalBroadcast,
    Intent,
    IntentKind,
    UpstreamMsg,
)
from flodl_bus.worker.hooks import JobHooks, bind_intent_sink, unbind_intent_sink


def test_result_hooks_fire_only_on_the_role_rank() -> None:
    calls: list[object] = []
    job = dataclasses.replace(
        digits.job,
        metrics_fn=lambda m: calls.append(("metrics", m.epoch)),
        eval_result_fn=lambda e, v: calls.append(("eval", e, v)),
    )
    role: list[int | None] = [None]
    hooks = JobHooks(job, 1, lambda: role[0])
    agg, ev = (
        EpochAggregated(EpochMetrics(epoch=3, avg_loss=0.5, epoch_ms=1.0)),
        EvalBroadcast(3, 0.9),
    )
    hooks.dispatched(agg)
    hooks.dispatched(ev)
    role[0] = 0
    hooks.dispatched(agg)
    assert calls == []
    role[0] = 1
    hooks.dispatched(agg)
    hooks.dispatched(ev)
    assert calls == [("metrics", 3), ("eval", 3, 0.9)]


def test_a_raising_result_hook_is_logged_and_training_goes_on() -> None:
    def bad(_m: EpochMetrics) -> None:
        raise ValueError("disk full")

    hooks = JobHooks(dataclasses.replace(digits.job, metrics_fn=bad), 0, lambda: 0)
    with capture_logs() as logs:
        hooks.dispatched(EpochAggregated(EpochMetrics(epoch=0, avg_loss=1.0, epoch_ms=1.0)))
    assert [(entry["event"], entry["error"]) for entry in logs] == [
        ("job_hook_failed", "metrics_fn raised ValueError: disk full")
    ]


def test_requests_publish_an_intent_of_the_rank_only_while_bound() -> None:
    sent: list[UpstreamMsg] = []
    bind_intent_sink(2, sent.append)
    try:
        request_eval()
        request_checkpoint()
    finally:
        unbind_intent_sink()
    assert sent == [Intent(2, IntentKind.EVAL_NOW), Intent(2, IntentKind.CHECKPOINT_NOW)]
    with pytest.raises(RuntimeError, match="outside a rank's training thread"):
        request_eval()
