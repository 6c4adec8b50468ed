"""The coordinator core's routing and lifecycle: callbacks, the end of a run,
aggregation, the state summary, intents and checkpoints (reference §4.11-§4.16)."""

from __future__ import annotations

from flodl_bus.coordinator.effects import Alert, Finished
from flodl_bus.protocol import messages as m
from tests.coordinator.drive import feed, metrics, msgs, plans, started, types


def test_checkpoint_failure_fails_over_to_the_next_live_rank() -> None:
    core, _ = started("nccl-sync", ws=3)
    out = core.handle(0, m.CheckpointResult(0, 4, 5.0, "disk full"), 0.0)
    assert [(o.rank, o.msg) for o in msgs(out, m.Checkpoint)] == [(1, m.Checkpoint(4, 1))]
    # One line says whose checkpoint failed and why, before it moves on.
    (alert,) = [o for o in out if isinstance(o, Alert)]
    assert (alert.event, alert.detail) == ("checkpoint_failed", "rank 0: disk full")
    core.handle(1, m.CheckpointResult(1, 4, 100.0), 0.0)
    core.handle(1, m.CheckpointResult(1, 5, 50.0), 0.0)
    assert core.roles.checkpoint == 1
    assert core.roles.ewma_ms["checkpoint"] == 85.0


def test_callback_time_is_excluded_from_the_window_wall() -> None:
    core, _ = started("nccl-cadence")
    feed(core, 0, 4)
    core.handle(0, m.EvalResult(0, 1, 1, 0.9, 25.0), 0.0)
    assert core.ledger.wall_ms[0] == 15.0
    core.handle(0, m.EpochFnElapsed(0, 1, 100.0), 0.0)
    assert core.ledger.wall_ms[0] == 0.0


def test_eval_result_is_broadcast() -> None:
    core, _ = started("nccl-sync")
    out = core.handle(1, m.EvalResult(1, 2, 2, 0.93, 1.0), 0.0)
    assert [o.msg for o in msgs(out, m.EvalBroadcast)] == [m.EvalBroadcast(2, 0.93)]


def test_cpu_eval_is_armed_before_request_params() -> None:
    core, out = started("cpu-cadence", total=20, num_epochs=3, eval_every=1)
    core.roles.pending_eval_intent = True
    for r, plan in plans(out).items():
        feed(core, r, plan.partition_size)
    order = types(core.tick(0.01))
    assert order.index("ArmConsensusEval") < order.index("RequestParams")


def test_final_reduce_precedes_shutdown_and_nccl_settle_gate_waits() -> None:
    core, out = started("nccl-sync", total=4)
    assert [p.partition_size for p in plans(out).values()] == [2, 2]
    feed(core, 0, 2)
    core.handle(0, metrics(0, 0, 2), 0.0)
    feed(core, 1, 1)
    assert msgs(core.tick(0.01), m.SyncNow)
    core.handle(0, m.SyncAck(0, 3), 0.02)
    feed(core, 1, 1)  # a batch never acks: it may have been trained before the SyncNow
    assert not core.reduce.settled()
    core.handle(1, m.SyncAck(1, 3), 0.02)
    core.handle(1, metrics(1, 0, 2), 0.02)
    out = core.tick(0.03)
    assert msgs(out, m.EpochAggregated)
    # trailing step of rank 1: a final consensus reduce, not yet Shutdown
    assert msgs(out, m.SyncNow) and not msgs(out, m.Shutdown)
    assert not msgs(core.tick(0.04), m.Shutdown)  # settle gate: SyncNow unacked
    core.handle(0, m.SyncAck(0, 4), 0.05)
    core.handle(1, m.SyncAck(1, 4), 0.05)
    out = core.tick(0.06)
    assert msgs(out, m.Shutdown) and isinstance(out[-1], Finished)
    assert core.global_step == 4


def test_final_eval_runs_before_shutdown_when_no_trailing_steps() -> None:
    core, out = started("cpu-sync", total=2, final_eval=True)
    for r in (0, 1):
        feed(core, r, 1)
    assert msgs(core.tick(0.01), m.RequestParams)
    for r in (0, 1):
        core.handle(r, m.SyncAck(r, 0), 0.02)
        core.handle(r, metrics(r, 0, 1), 0.02)
    out = core.tick(0.03)
    assert msgs(out, m.WireUpdate) and msgs(out, m.EpochAggregated)
    evals = msgs(out, m.ExecuteEvalCallback)
    assert evals and evals[0].msg.schedule_id == m.FINAL_EVAL_SCHEDULE
    assert evals[0].msg.adopt_consensus  # CPU: score the retained consensus
    assert not msgs(out, m.Shutdown)
    assert not msgs(core.tick(0.04), m.Shutdown)
    core.handle(0, m.EvalResult(0, m.FINAL_EVAL_SCHEDULE, 1, 0.97, 3.0), 0.05)
    out = core.tick(0.06)
    assert types(out)[-1] == "Shutdown" and isinstance(out[-1], Finished)


def test_the_final_eval_rank_dying_does_not_hold_the_shutdown_forever() -> None:
    core, out = started("cpu-sync", total=2, final_eval=True)
    for r in (0, 1):
        feed(core, r, 1)
    core.tick(0.01)
    for r in (0, 1):
        core.handle(r, m.SyncAck(r, 0), 0.02)
        core.handle(r, metrics(r, 0, 1), 0.02)
    evals = msgs(core.tick(0.03), m.ExecuteEvalCallback)
    evaluator = evals[0].msg.target_rank
    assert not msgs(core.tick(0.04), m.Shutdown)
    # The evaluator dies before answering: the role moves on, the wait must not.
    core.declare_dead(evaluator, 0.05)
    out = core.tick(0.06)
    assert msgs(out, m.Shutdown) or msgs(out, m.ShutdownWithSave)
    assert any(isinstance(o, Finished) for o in out)


def test_an_interrupt_shuts_down_once_and_nothing_is_dispatched_after_it() -> None:
    core, out = started("cpu-cadence", total=64)
    out = core.interrupt(0.1)
    assert types(out) == ["Shutdown"] and isinstance(out[-1], Finished)
    assert core.interrupt(0.2) == []
    after = core.handle(0, metrics(0, 0, 2), 0.3) + core.tick(0.4)
    assert not msgs(after, m.StartEpoch) and not msgs(after, m.Shutdown)


def test_epoch_aggregated_carries_batch_weighted_loss() -> None:
    core, out = started("nccl-sync", total=100, num_epochs=2)
    core.handle(0, m.MetricsMsg(0, 0, 0.5, 60, 1.0, 50, 1.0, 1.0, 0.0), 0.0)
    core.handle(1, m.MetricsMsg(1, 0, 0.7, 40, 1.0, 50, 1.0, 1.0, 0.0), 0.0)
    out = core.tick(0.01)
    agg = msgs(out, m.EpochAggregated)
    assert abs(agg[0].msg.metrics.avg_loss - 0.58) < 1e-12
    assert {p.epoch for p in plans(out).values()} == {1}


def test_state_summary_reports_why_the_gate_is_closed() -> None:
    core, _ = started("nccl-cadence")
    feed(core, 0, 3)
    s = core.state_summary()
    assert s["gate"] == {"open": False, "why": "rank 0 at 3/10 steps"}
    assert s["steps"] == [3, 0] and s["version"] == 0
    assert s["in_flight"][0] > 0


def test_eval_intent_folds_into_the_next_nccl_epoch_dispatch() -> None:
    core, out = started("nccl-sync", total=4, num_epochs=2)
    core.handle(1, m.Intent(1, m.IntentKind.EVAL_NOW), 0.0)
    for r in (0, 1):
        feed(core, r, 2)
        core.handle(r, metrics(r, 0, 2), 0.0)
    out = core.tick(0.01)
    evals = msgs(out, m.ExecuteEvalCallback)
    assert [(o.rank, o.msg.epoch) for o in evals] == [(core.roles.eval, 1)]
    order = types(out)
    assert order.index("ExecuteEvalCallback") < order.index("StartEpoch")
    assert not core.roles.pending_eval_intent


def test_checkpoint_every_n_epochs_goes_to_the_checkpoint_role_only() -> None:
    core, out = started("nccl-sync", total=4, num_epochs=3, checkpoint_every=2)
    sent: list[tuple[int, m.Checkpoint]] = []
    for epoch in range(3):
        for r in (0, 1):
            feed(core, r, 2)
            core.handle(r, metrics(r, epoch, 2), 0.0)
        out = core.tick(0.01 * (epoch + 1))
        sent += [(o.rank, o.msg) for o in msgs(out, m.Checkpoint)]
        for r in (0, 1):
            core.handle(r, m.SyncAck(r, core.reduce.last_step_count[r] + 1), 0.0)
    assert sent == [(core.roles.checkpoint, m.Checkpoint(2, core.roles.checkpoint))]
