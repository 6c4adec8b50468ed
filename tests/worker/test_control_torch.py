"""WorkerControl, arm by arm (seed 000, reference §3.5-3.11), against the torch-backed
ports of a real rank (``LocalParams``, ``TorchModelPort``): the integration side of
``test_control.py``, which pins the same rules without torch."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from flodl_bus.examples import digits
from flodl_bus.job import accuracy
from flodl_bus.partition import SHUFFLE_BASE_SEED, make_partition
from flodl_bus.protocol.messages import (
    ArmConsensusEval,
    AveragedParams,
    Batch,
    Checkpoint,
    CheckpointResult,
    ControlMsg,
    EpochAggregated,
    EpochMetrics,
    EpochPlan,
    EvalBroadcast,
    EvalResult,
    ExecuteEvalCallback,
    ExtendPartition,
    LrUpdate,
    RequestParams,
    SaveConsensusModel,
    SaveReason,
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
)
from flodl_bus.worker.control import PARAM_NORM_EVERY, Dispatched
from flodl_bus.worker.rank import _checkpoint_fn
from tests.worker.rig import Core, ListStager, StepClock, make_core


@pytest.fixture
def core() -> Core:
    return make_core()


def steps(core: Core, n: int) -> None:
    for _ in range(n):
        core.control.step_done(1.0, 1.0, 0.0, 0.1)


def averaged(core: Core, version: int, scale: float = 0.0) -> AveragedParams:
    params = tuple(torch.full_like(p, scale) for p in core.model.parameters())
    buffers = tuple(b.clone() for b in core.model.buffers())
    return AveragedParams(params=params, buffers=buffers, version=version)


# ---------------------------------------------------------------- step accounting


def test_request_params_records_steps_at_snapshot_and_ships_that_mass(core: Core) -> None:
    steps(core, 5)
    out = core.control.dispatch(RequestParams())
    assert out == Dispatched()
    assert core.control.steps_at_snapshot == 5
    assert core.params.calls == [("snapshot", 5)]
    # The world-of-one plane hands back the "average" as an Update on the control queue.
    assert len(core.injected) == 1 and isinstance(core.injected[0], Update)
    assert core.injected[0].avg.realized


def test_update_after_overshoot_keeps_the_steps_taken_since_the_snapshot(core: Core) -> None:
    steps(core, 5)
    core.control.dispatch(RequestParams())
    steps(core, 3)
    core.control.dispatch(core.injected[0])
    assert core.control.steps_since_avg == 3
    assert core.control.steps_at_snapshot == 0
    assert core.control.local_step == 8  # monotone, untouched by averaging


def test_duplicate_update_subtracts_nothing(core: Core) -> None:
    steps(core, 5)
    core.control.dispatch(RequestParams())
    steps(core, 3)
    update = core.injected[0]
    core.control.dispatch(update)
    core.control.dispatch(update)
    assert core.control.steps_since_avg == 3
    assert core.params.names().count("load_averaged") == 2


def test_update_loads_the_average_into_the_model_and_records_its_version(core: Core) -> None:
    steps(core, 2)
    core.control.dispatch(RequestParams())
    core.control.dispatch(Update(averaged(core, version=7, scale=0.5)))
    assert all(torch.all(p == 0.5) for p in core.model.parameters())
    assert core.control.current_version == 7
    assert core.control.steps_since_avg == 0


def test_update_subtraction_saturates_at_zero(core: Core) -> None:
    steps(core, 4)
    core.control.dispatch(RequestParams())
    core.control.steps_since_avg = 1  # fewer steps than shipped can never go negative
    core.control.dispatch(core.injected[0])
    assert core.control.steps_since_avg == 0


def test_update_with_a_wrong_tensor_count_is_fatal(core: Core) -> None:
    bad = AveragedParams(params=(torch.zeros(1),), buffers=(), version=1)
    with pytest.raises(ValueError, match="params"):
        core.control.dispatch(Update(bad))


def test_sync_now_zeroes_both_counters_bumps_local_step_and_acks_not_batches(
    core: Core,
) -> None:
    steps(core, 6)
    core.control.dispatch(RequestParams())
    steps(core, 1)
    out = core.control.dispatch(SyncNow())
    assert core.params.calls[-1] == ("sync_now", 7)
    assert core.control.steps_since_avg == 0
    assert core.control.steps_at_snapshot == 0
    assert core.control.local_step == 8
    assert len(out.upstream) == 1
    ack = out.upstream[0]
    assert isinstance(ack, SyncAck) and not any(isinstance(u, Batch) for u in out.upstream)
    norm = core.params.param_norm()
    assert ack == SyncAck(rank=0, step_count=8, divergence=0.0, post_norm=norm, pre_norm=norm)
    assert not out.stop


def test_step_done_reports_batch_and_lr_with_param_norm_every_tenth_step(core: Core) -> None:
    reports = [core.control.step_done(0.5, 2.0, 0.25, 0.01) for _ in range(2 * PARAM_NORM_EVERY)]
    norms = [b.param_norm for b, _ in reports]
    assert [i + 1 for i, n in enumerate(norms) if n is not None] == [10, 20]
    assert norms[9] == pytest.approx(core.params.param_norm())
    batch, lr = reports[0]
    assert batch == Batch(
        rank=0, batch_ms=2.0, data_ms=0.25, step_count=1, batch_loss=0.5, param_norm=None
    )
    assert lr == LrUpdate(rank=0, lr=0.01)


def test_param_norm_cadence_follows_steps_since_avg_not_local_step(core: Core) -> None:
    steps(core, 4)
    core.control.dispatch(SyncNow())  # local_step 5, steps_since_avg 0
    reports = [core.control.step_done(0.5, 1.0, 0.0, 0.1) for _ in range(PARAM_NORM_EVERY)]
    assert [b.step_count for b, _ in reports if b.param_norm is not None] == [15]


def test_lr_position_is_global_step_plus_steps_since_avg(core: Core) -> None:
    core.control.dispatch(SetGlobalStep(100))
    assert core.control.global_step == 100
    steps(core, 3)
    assert core.control.lr_position == 103


# ---------------------------------------------------------------------- plans


def test_start_epoch_fills_the_single_pending_slot(core: Core) -> None:
    plan = EpochPlan(epoch=1, partition_offset=0, partition_size=64)
    assert core.control.dispatch(StartEpoch(plan)) == Dispatched()
    assert core.control.pending_plan == plan
    assert core.control.take_pending_plan() == plan
    assert core.control.pending_plan is None


def test_start_epoch_overwrite_logs_loudly_naming_both_plans_and_keeps_the_newer(
    core: Core,
) -> None:
    old = EpochPlan(epoch=1, partition_offset=0, partition_size=64)
    new = EpochPlan(epoch=1, partition_offset=64, partition_size=32)
    core.control.dispatch(StartEpoch(old))
    logs = core.control.dispatch(StartEpoch(new)).logs
    errors = [e for e in logs if e.level == "error"]
    assert len(errors) == 1
    err = errors[0]
    assert err.event == "one_chunk_in_flight_violated"
    assert err.fields["dropped_plan"] == {"epoch": 1, "partition_offset": 0, "partition_size": 64}
    assert err.fields["kept_plan"] == {"epoch": 1, "partition_offset": 64, "partition_size": 32}
    assert core.control.pending_plan == new


def test_extend_partition_appends_the_same_permutation_slice(core: Core) -> None:
    space = len(digits.train_data())
    core.control.begin_plan(EpochPlan(epoch=3, partition_offset=100, partition_size=64))
    assert core.control.num_batches == 2
    core.control.dispatch(ExtendPartition(partition_offset=500, partition_size=40))
    expected = make_partition(100, 64, space, 3, SHUFFLE_BASE_SEED) + make_partition(
        500, 40, space, 3, SHUFFLE_BASE_SEED
    )
    assert core.control.partition == expected
    assert core.control.num_batches == 104 // 32
    # Same epoch's permutation: a different epoch would give other picks.
    assert core.control.partition[64:] != make_partition(500, 40, space, 4, SHUFFLE_BASE_SEED)


# -------------------------------------------------------------------- throttle


def throttled(core: Core) -> Core:
    out = core.control.dispatch(Throttle())
    assert out == Dispatched(throttled=True)
    return core


@pytest.mark.parametrize("release", ["SyncNow", "Update", "Shutdown"])
def test_throttle_is_released_by_sync_now_update_or_shutdown(core: Core, release: str) -> None:
    throttled(core)
    steps(core, 2)
    if release == "SyncNow":
        msg: ControlMsg = SyncNow()
    elif release == "Update":
        core.control.dispatch(RequestParams())
        msg = core.injected[0]
    else:
        msg = Shutdown()
    out = core.control.dispatch(msg)
    assert not out.throttled and not core.control.throttled
    assert out.stop == (release == "Shutdown")


def test_throttle_services_request_params_and_start_epoch_without_releasing(
    core: Core,
) -> None:
    throttled(core)
    steps(core, 4)
    out = core.control.dispatch(RequestParams())
    assert out.throttled and core.params.calls == [("snapshot", 4)]
    plan = EpochPlan(epoch=0, partition_offset=0, partition_size=32)
    out = core.control.dispatch(StartEpoch(plan))
    assert out.throttled and core.control.pending_plan == plan
    out = core.control.dispatch(SetGlobalStep(9))
    assert out.throttled and core.control.global_step == 9


def test_throttle_while_throttled_is_ignored(core: Core) -> None:
    throttled(core)
    assert core.control.dispatch(Throttle()) == Dispatched(throttled=True)
    out = core.control.dispatch(SyncNow())  # one release suffices: it never nests
    assert not out.throttled


def test_shutdown_with_save_while_throttled_releases_and_stops(core: Core) -> None:
    throttled(core)
    out = core.control.dispatch(ShutdownWithSave(SaveReason.REDUCE_STALL))
    assert out.stop and not out.throttled


def test_a_closed_channel_while_throttled_means_stop(core: Core) -> None:
    throttled(core)
    assert core.control.channel_closed().stop
    assert not core.control.throttled


# ------------------------------------------------------------------- targeting


def test_checkpoint_on_its_target_runs_the_callback_and_reports_elapsed(tmp_path: Path) -> None:
    seen: list[int] = []
    c = make_core(rank=1, checkpoint_fn=lambda v, m: seen.append(v), clock=StepClock(0.25))
    out = c.control.dispatch(Checkpoint(version=4, target_rank=1))
    assert seen == [4]
    assert out.upstream == (CheckpointResult(rank=1, version=4, elapsed_ms=250.0, error=None),)


def test_checkpoint_for_another_rank_is_ignored() -> None:
    seen: list[int] = []
    c = make_core(rank=0, checkpoint_fn=lambda v, m: seen.append(v))
    assert c.control.dispatch(Checkpoint(version=4, target_rank=1)) == Dispatched()
    assert seen == []


def test_checkpoint_without_a_callback_reports_an_error() -> None:
    c = make_core(rank=2)
    (result,) = c.control.dispatch(Checkpoint(version=1, target_rank=2)).upstream
    assert isinstance(result, CheckpointResult)
    assert result.error is not None and "checkpoint_fn" in result.error and "rank 2" in result.error


def test_checkpoint_callback_failure_is_reported_not_raised() -> None:
    def boom(version: int, model: nn.Module) -> None:
        raise OSError("disk full")

    c = make_core(checkpoint_fn=boom)
    (result,) = c.control.dispatch(Checkpoint(version=1, target_rank=0)).upstream
    assert isinstance(result, CheckpointResult) and result.error == "OSError: disk full"


def test_a_failing_job_checkpoint_fn_is_one_line_naming_it_once() -> None:
    def boom(version: int, model: nn.Module) -> None:
        raise ValueError("no room")

    # The rank's own wiring of the job's hook (what the run uses).
    hook = _checkpoint_fn(dataclasses.replace(digits.job, checkpoint_fn=boom), None)
    c = make_core(checkpoint_fn=hook)
    (result,) = c.control.dispatch(Checkpoint(version=3, target_rank=0)).upstream
    assert isinstance(result, CheckpointResult)
    assert result.error == "checkpoint_fn raised ValueError: no room"


def test_eval_on_its_target_runs_in_eval_mode_then_returns_to_train_mode() -> None:
    modes: list[bool] = []

    def eval_fn(model: nn.Module, data: object) -> float:
        modes.append(model.training)
        return accuracy(model, data)  # type: ignore[arg-type]

    c = make_core(rank=1, eval_fn=eval_fn, clock=StepClock(0.5))
    c.model.train()
    (result,) = c.control.dispatch(
        ExecuteEvalCallback(schedule_id=3, epoch=3, target_rank=1)
    ).upstream
    assert modes == [False]
    assert c.model.training
    assert isinstance(result, EvalResult)
    assert result.error is None and 0.0 <= result.metric <= 1.0
    assert (result.rank, result.schedule_id, result.epoch, result.elapsed_ms) == (1, 3, 3, 500.0)


def test_eval_without_an_eval_dataset_reports_an_error_and_nan() -> None:
    c = make_core(eval_fn=lambda m, d: 1.0, with_eval_data=False)
    (result,) = c.control.dispatch(ExecuteEvalCallback(1, 1, target_rank=0)).upstream
    assert isinstance(result, EvalResult)
    assert math.isnan(result.metric)
    assert result.error is not None and "eval dataset" in result.error


def test_eval_callback_failure_reports_nan_and_still_returns_to_train_mode() -> None:
    def eval_fn(model: nn.Module, data: object) -> float:
        raise RuntimeError("bad eval")

    c = make_core(eval_fn=eval_fn)
    c.model.train()
    (result,) = c.control.dispatch(ExecuteEvalCallback(1, 1, target_rank=0)).upstream
    assert isinstance(result, EvalResult)
    assert math.isnan(result.metric) and result.error == "RuntimeError: bad eval"
    assert c.model.training


def test_eval_for_another_rank_or_without_eval_fn_is_silent() -> None:
    calls: list[int] = []
    c = make_core(rank=0, eval_fn=lambda m, d: float(calls.append(1) or 0))
    assert c.control.dispatch(ExecuteEvalCallback(1, 1, target_rank=1)) == Dispatched()
    assert calls == []
    no_fn = make_core(rank=0, eval_fn=None)
    assert no_fn.control.dispatch(ExecuteEvalCallback(1, 1, target_rank=0)) == Dispatched()


def test_save_consensus_model_writes_the_model_on_its_target_and_each_ranks_state(
    tmp_path: Path,
) -> None:
    stem = tmp_path / "run" / "ckpt"
    other = make_core(rank=1, save_path=str(stem))
    assert other.control.dispatch(SaveConsensusModel(target_rank=0)) == Dispatched()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["ckpt.rank1.state.pt"]
    target = make_core(rank=0, save_path=str(stem))
    assert target.control.dispatch(SaveConsensusModel(target_rank=0)) == Dispatched()
    saved = torch.load(tmp_path / "run" / "ckpt.model.pt")
    assert set(saved) == set(target.model.state_dict())


def test_save_consensus_model_without_a_save_path_logs_and_goes_on() -> None:
    c = make_core()
    out = c.control.dispatch(SaveConsensusModel(target_rank=0))
    assert (out.upstream, out.stop, out.throttled) == ((), False, False)
    assert [e.event for e in out.logs] == ["save_consensus_without_save_path"]


def test_arm_consensus_eval_is_stored_only_on_its_target(core: Core) -> None:
    core.control.dispatch(ArmConsensusEval(schedule_id=5, epoch=2, target_rank=1))
    assert core.control.pending_consensus_eval is None
    core.control.dispatch(ArmConsensusEval(schedule_id=5, epoch=2, target_rank=0))
    core.control.dispatch(ArmConsensusEval(schedule_id=6, epoch=3, target_rank=0))
    assert core.control.pending_consensus_eval == (6, 3)


def test_an_armed_eval_scores_the_next_realized_consensus_once() -> None:
    seen: list[float] = []

    def eval_fn(model: torch.nn.Module, data: object) -> float:
        value = float(next(model.parameters()).detach().flatten()[0])
        seen.append(value)
        return value

    c = make_core(rank=0, eval_fn=eval_fn)
    c.control.dispatch(ArmConsensusEval(schedule_id=4, epoch=4, target_rank=0))
    # An unrealized round (nobody moved) is no consensus: the eval stays armed.
    unrealized = AveragedParams(
        params=averaged(c, 1).params, buffers=averaged(c, 1).buffers, version=1, realized=False
    )
    assert c.control.dispatch(Update(unrealized)) == Dispatched()
    assert c.control.pending_consensus_eval == (4, 4)
    # The realized one is adopted, then scored: the metric is the consensus (0.25).
    (result,) = c.control.dispatch(Update(averaged(c, version=2, scale=0.25))).upstream
    assert isinstance(result, EvalResult)
    assert (result.schedule_id, result.epoch, result.metric) == (4, 4, 0.25)
    assert c.control.pending_consensus_eval is None
    assert c.control.dispatch(Update(averaged(c, version=3, scale=0.5))) == Dispatched()
    assert seen == [0.25]


# -------------------------------------------------------------------- shutdown


def test_shutdown_stops(core: Core) -> None:
    assert core.control.dispatch(Shutdown()) == Dispatched(stop=True)


def test_shutdown_with_save_writes_the_bundle_and_stops(tmp_path: Path) -> None:
    stem = tmp_path / "final"
    c = make_core(rank=0, save_path=str(stem))
    out = c.control.dispatch(ShutdownWithSave(SaveReason.SINGLE_SURVIVOR))
    assert out.stop
    assert (tmp_path / "final.model.pt").exists()
    assert (tmp_path / "final.rank0.state.pt").exists()
    assert '"single_survivor"' in (tmp_path / "final.bundle.json").read_text()
    # the coordinator's checkpoint meta (resume coverage) is left alone
    assert not (tmp_path / "final.meta.json").exists()


def test_shutdown_with_save_without_a_save_path_logs_and_stops(core: Core) -> None:
    out = core.control.dispatch(ShutdownWithSave(SaveReason.GRACEFUL_SHUTDOWN))
    assert out.stop
    assert [e.event for e in out.logs] == ["shutdown_with_save_without_save_path"]


# ---------------------------------------------------------------- stored state


def test_set_epoch_callback_role_is_stored(core: Core) -> None:
    core.control.dispatch(SetEpochCallbackRole(rank=3))
    assert core.control.epoch_callback_role == 3


def test_epoch_aggregated_keeps_the_latest(core: Core) -> None:
    first = EpochMetrics(epoch=0, avg_loss=2.0, epoch_ms=10.0)
    second = EpochMetrics(epoch=1, avg_loss=1.0, epoch_ms=9.0)
    core.control.dispatch(EpochAggregated(first))
    core.control.dispatch(EpochAggregated(second))
    assert core.control.aggregated_metrics == second


def test_eval_broadcast_keeps_the_latest(core: Core) -> None:
    core.control.dispatch(EvalBroadcast(epoch=1, metric=0.8))
    core.control.dispatch(EvalBroadcast(epoch=2, metric=0.9))
    assert core.control.last_eval_broadcast == (2, 0.9)


def test_stage_advisory_is_forwarded_to_the_stager_and_ignored_without_one() -> None:
    advisory = StageAdvisory(counts=(3, 4), segments=((0, ((0, 32), (64, 32))),))
    stager = ListStager()
    c = make_core(stager=stager)
    assert c.control.dispatch(advisory) == Dispatched()
    assert stager.advisories == [advisory]
    assert make_core().control.dispatch(advisory) == Dispatched()


def test_the_same_messages_replayed_into_a_fresh_core_give_the_same_outputs() -> None:
    def run() -> tuple[list[Dispatched], dict[str, object]]:
        c = make_core(checkpoint_fn=lambda v, m: None, clock=StepClock(0.125))
        script: list[ControlMsg] = [
            SetGlobalStep(10),
            StartEpoch(EpochPlan(0, 0, 64)),
            Throttle(),
            RequestParams(),
            SyncNow(),
            Checkpoint(1, 0),
            ExtendPartition(64, 32),
        ]
        outs = []
        for i, msg in enumerate(script):
            steps(c, i)
            outs.append(c.control.dispatch(msg))
        return outs, c.control.state()

    assert run() == run()
