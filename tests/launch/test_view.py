"""RunView: what the launcher derives from the messages it reads off the streams."""

from __future__ import annotations

import math

from flodl_bus.launch.view import RunView
from flodl_bus.protocol.messages import (
    Batch,
    EpochAggregated,
    EpochMetrics,
    EpochPlan,
    EvalBroadcast,
    EvalResult,
    Exiting,
    MetricsMsg,
    StartEpoch,
    SyncNow,
    WireUpdate,
)


def _agg(epoch: int, loss: float = 1.0, thru: tuple[float, ...] = (2.0, 3.0)) -> EpochAggregated:
    return EpochAggregated(
        EpochMetrics(epoch=epoch, avg_loss=loss, epoch_ms=500.0, per_rank_throughput=thru)
    )


def _batch(rank: int, loss: float = 0.5) -> Batch:
    return Batch(rank=rank, batch_ms=1.0, data_ms=0.1, step_count=1, batch_loss=loss)


def test_first_step_is_the_first_batch_seen_relative_to_the_launch() -> None:
    view = RunView(2, started_at=100.0)
    assert view.time_to_first_step() is None
    view.on_upstream(1, _batch(1), now=103.5)
    view.on_upstream(0, _batch(0), now=104.0)
    assert view.time_to_first_step() == 3.5
    assert [r.batches for r in view.ranks] == [1, 1]
    assert view.total_batches == 2


def test_batches_count_per_rank_and_keep_the_last_loss() -> None:
    view = RunView(2, started_at=0.0)
    for loss in (0.9, 0.7, 0.4):
        view.on_upstream(0, _batch(0, loss), now=1.0)
    view.on_control(0, StartEpoch(EpochPlan(epoch=3, partition_offset=0, partition_size=8)), 1.0)
    assert view.ranks[0].batches == 3
    assert view.ranks[0].loss == 0.4
    assert view.ranks[0].epoch == 3
    assert view.ranks[1].batches == 0


def _report(rank: int, epoch: int) -> MetricsMsg:
    return MetricsMsg(rank, epoch, 0.5, 1, 1.0, 8, 1.0, 1.0, 0.0)


def test_a_ranks_epoch_follows_plans_sent_alone_or_with_an_update() -> None:
    view = RunView(1, started_at=0.0)
    view.on_control(0, StartEpoch(EpochPlan(epoch=0, partition_offset=0, partition_size=8)), 1.0)
    assert view.ranks[0].epoch == 0
    view.on_upstream(0, _report(0, 0), 1.5)
    view.on_control(0, WireUpdate(version=1, next_plan=EpochPlan(1, 8, 8)), 2.0)
    assert view.ranks[0].epoch == 1


def test_a_plan_held_ahead_moves_a_ranks_epoch_only_once_the_one_before_is_reported() -> None:
    # a world of one holds its next epoch's plan while it trains this one (issue 27)
    view = RunView(1, started_at=0.0)
    for epoch in (0, 1):
        view.on_control(0, StartEpoch(EpochPlan(epoch, 0, 8)), 1.0)
    assert view.ranks[0].epoch == 0
    view.on_upstream(0, _report(0, 0), 2.0)
    assert view.ranks[0].epoch == 1
    view.on_control(0, StartEpoch(EpochPlan(2, 0, 8)), 2.0)
    assert view.ranks[0].epoch == 1
    view.on_upstream(0, _report(0, 2), 3.0)  # a report of 1 this view missed
    assert view.ranks[0].epoch == 2 and not view.ranks[0].held


def test_cpu_syncs_are_the_highest_update_version_seen() -> None:
    view = RunView(2, started_at=0.0)
    view.on_control(0, WireUpdate(version=1), 1.0)
    view.on_control(1, WireUpdate(version=1), 1.0)
    view.on_control(1, WireUpdate(version=2), 1.0)
    assert view.syncs == 2


def test_nccl_syncs_count_broadcast_and_unicast_sync_now() -> None:
    view = RunView(2, started_at=0.0)
    view.on_control(None, SyncNow(), 1.0)
    view.on_control(0, SyncNow(), 1.0)
    view.on_control(1, SyncNow(), 1.0)
    assert view.syncs == 2


def test_a_row_waits_for_the_eval_of_its_epoch_tagged_one_later() -> None:
    view = RunView(2, started_at=0.0)
    view.on_control(None, _agg(0, loss=2.0), now=5.0)
    assert view.rows_ready() == []
    # The eval tagged 1 runs as epoch 1 begins: it scores the model after epoch 0.
    view.on_control(None, EvalBroadcast(epoch=1, metric=0.75), now=5.5)
    [row] = view.rows_ready()
    assert (row.epoch, row.loss, row.metric, row.at) == (0, 2.0, 0.75, 5.0)
    assert row.throughput == (2000.0, 3000.0)  # samples/ms on the wire, samples/s shown
    assert view.rows_ready() == []


def test_a_row_without_its_eval_is_shown_once_the_next_epoch_is_aggregated() -> None:
    view = RunView(2, started_at=0.0)
    view.on_control(None, _agg(0), now=1.0)
    view.on_control(None, _agg(1), now=2.0)
    rows = view.rows_ready()
    assert [r.epoch for r in rows] == [0]
    assert rows[0].metric is None
    assert [r.epoch for r in view.rows_ready(final=True)] == [1]


def test_syncs_per_row_are_the_rounds_between_aggregates() -> None:
    view = RunView(2, started_at=0.0)
    view.on_control(0, WireUpdate(version=3), 1.0)
    view.on_control(None, _agg(0), 1.0)
    view.on_control(0, WireUpdate(version=5), 2.0)
    view.on_control(None, _agg(1), 2.0)
    rows = view.rows_ready(final=True)
    assert [(r.syncs, r.syncs_total) for r in rows] == [(3, 3), (2, 5)]


def test_the_anchor_comes_from_note_anchor_per_epoch() -> None:
    view = RunView(1, started_at=0.0)
    view.on_control(None, _agg(0, thru=(1.0,)), 1.0)
    view.note_anchor(0, 20)
    [row] = view.rows_ready(final=True)
    assert row.anchor == 20


def test_rank_eval_results_count_and_errors_or_nan_do_not() -> None:
    view = RunView(2, started_at=0.0)
    view.on_upstream(0, EvalResult(0, 1, 1, 0.5, 3.0), 1.0)
    view.on_upstream(0, EvalResult(0, 2, 2, 0.9, 3.0, error="boom"), 1.0)
    view.on_upstream(0, EvalResult(0, 3, 3, math.nan, 3.0), 1.0)
    assert view.evals == {1: 0.5}
    assert view.last_metric == 0.5


def test_the_final_metric_is_the_last_eval_to_arrive() -> None:
    view = RunView(1, started_at=0.0)
    view.on_control(None, EvalBroadcast(epoch=4, metric=0.93), 1.0)
    view.on_control(None, EvalBroadcast(epoch=3, metric=0.91), 2.0)
    assert view.last_metric == 0.91


def test_messages_of_ranks_outside_the_world_are_ignored() -> None:
    view = RunView(1, started_at=0.0)
    view.on_upstream(5, _batch(5), 1.0)
    view.on_control(7, SyncNow(), 1.0)
    view.on_upstream(0, Exiting(rank=0), 1.0)
    assert view.total_batches == 0
    assert view.syncs == 0
    assert view.ranks[0].exited


def test_a_failed_eval_is_a_console_note_naming_its_cause() -> None:
    """Issue 30: a failing final eval showed `final metric -` with the cause only in a
    rank's log."""
    view = RunView(2, started_at=0.0)
    view.on_upstream(
        1, EvalResult(1, 9, 3, math.nan, 2.0, error="eval_fn raised KeyError('x')"), 1.0
    )
    assert view.final_metric is None
    assert view.take_notes() == [
        "rank 1: the eval scheduled at epoch 3 failed: eval_fn raised KeyError('x')"
    ]
