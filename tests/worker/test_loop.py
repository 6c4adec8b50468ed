"""The training thread on the real digits model (reference §3.2-3.4, §3.7)."""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs
from torch import nn
from torch.utils.data import Dataset

from flodl_bus.examples import digits
from flodl_bus.job import Job, JobError, classification_loss
from flodl_bus.protocol.messages import (
    Batch,
    ControlMsg,
    EpochFnElapsed,
    EpochPlan,
    Exiting,
    ExtendPartition,
    LrUpdate,
    MetricsMsg,
    RequestParams,
    SaveReason,
    SetEpochCallbackRole,
    SetGlobalStep,
    Shutdown,
    ShutdownWithSave,
    StartEpoch,
    SyncAck,
    SyncNow,
    Throttle,
    UpstreamMsg,
)
from flodl_bus.worker.control import Dispatched, Phase, WorkerControl
from flodl_bus.worker.feed import ArrayFeed, Feed, LoaderFeed
from flodl_bus.worker.inbox import Inbox
from flodl_bus.worker.loop import RankLoop, record_scalar
from tests.worker.rig import ObservedParams

TRAIN = digits.train_data()
BS = digits.job.batch_size
EPOCH_SIZE = len(TRAIN)
CPU = torch.device("cpu")


@dataclass
class Rig:
    loop: RankLoop
    control: WorkerControl
    inbox: Inbox
    params: ObservedParams
    model: nn.Module
    published: list[UpstreamMsg]

    def put(self, *msgs: ControlMsg) -> None:
        for m in msgs:
            self.inbox.put(m)

    def of(self, cls: type) -> list[Any]:
        return [m for m in self.published if isinstance(m, cls)]


def make_rig(
    job: Job = digits.job,
    rank: int = 0,
    after_metrics: list[list[ControlMsg]] | None = None,
    **loop_kw: Any,
) -> Rig:
    """``after_metrics[i]`` is queued when the i-th MetricsMsg is published: a scripted
    coordinator that hands out the next plan only when the previous one completed."""
    torch.manual_seed(job.seed)
    model = job.build_model()
    inbox = Inbox()
    published: list[UpstreamMsg] = []
    script = list(after_metrics or [])

    class Published(list[UpstreamMsg]):
        def append(self, msg: UpstreamMsg) -> None:
            super().append(msg)
            if isinstance(msg, MetricsMsg) and script:
                for m in script.pop(0):
                    inbox.put(m)

    published = Published()
    params = ObservedParams(model, rank=rank, inject=inbox.put, publish=published.append)
    control = WorkerControl(
        rank=rank,
        params=params,
        batch_size=job.batch_size,
        pick_space=EPOCH_SIZE,
        clock=time.perf_counter,
    )
    loop = RankLoop(
        job=job,
        control=control,
        inbox=inbox,
        publish=published.append,
        model=model,
        optimizer=job.build_optimizer(model),
        train_data=TRAIN,
        **loop_kw,
    )
    return Rig(loop, control, inbox, params, model, published)


# ------------------------------------------------------------------ draining


def test_handle_control_dispatches_everything_queued_without_blocking() -> None:
    rig = make_rig()
    rig.put(SetGlobalStep(7), SetEpochCallbackRole(2))
    assert rig.loop.handle_control() is False
    assert (rig.control.global_step, rig.control.epoch_callback_role) == (7, 2)
    assert len(rig.inbox) == 0
    assert rig.loop.handle_control() is False  # empty queue returns at once


def test_handle_control_stops_at_shutdown_and_leaves_the_rest_queued() -> None:
    rig = make_rig()
    rig.put(Shutdown(), SetGlobalStep(7))
    assert rig.loop.handle_control() is True
    assert rig.control.global_step == 0 and len(rig.inbox) == 1


def test_a_throttle_blocks_until_a_release_arrives() -> None:
    rig = make_rig()
    plan = EpochPlan(0, 0, 64)
    rig.put(Throttle(), SetGlobalStep(3), StartEpoch(plan), Throttle())
    result: list[bool] = []
    worker = threading.Thread(target=lambda: result.append(rig.loop.handle_control()))
    worker.start()
    worker.join(timeout=0.3)
    # Parked, but what arrived meanwhile was serviced.
    assert worker.is_alive() and result == []
    assert rig.control.throttled
    assert rig.control.global_step == 3 and rig.control.pending_plan == plan
    rig.put(SyncNow())
    worker.join(timeout=5)
    assert result == [False]  # released: training goes on
    assert not rig.control.throttled and len(rig.of(SyncAck)) == 1


def test_the_update_of_a_snapshot_round_releases_a_throttle() -> None:
    rig = make_rig()
    # The world-of-one plane queues Update(avg) as soon as it snapshots.
    rig.put(Throttle(), RequestParams())
    assert rig.loop.handle_control() is False
    assert rig.params.names() == ["snapshot", "load_averaged"]
    assert not rig.control.throttled


def test_a_throttle_with_a_closed_channel_stops() -> None:
    rig = make_rig()
    rig.put(Throttle())
    rig.inbox.close()
    assert rig.loop.handle_control() is True


def test_teardown_drops_everything_but_a_queued_shutdown() -> None:
    rig = make_rig()
    rig.put(SyncNow(), SetGlobalStep(5), Throttle(), Shutdown(), SetGlobalStep(99))
    rig.loop.drain_pending_shutdown()
    assert "sync_now" not in rig.params.names()
    assert rig.of(SyncAck) == []
    assert rig.control.global_step == 0 and not rig.control.throttled
    assert rig.control.phase is Phase.STOPPED
    assert len(rig.inbox) == 1  # after the Shutdown: never reached


def test_a_plan_read_while_idle_goes_through_the_core_mailbox() -> None:
    rig = make_rig()
    plan = EpochPlan(0, 0, 64)
    rig.put(StartEpoch(plan))
    seen: list[object] = []
    real = rig.control.dispatch

    def dispatch(msg: ControlMsg) -> Dispatched:
        seen.append(msg)
        return real(msg)

    rig.control.dispatch = dispatch  # type: ignore[method-assign]
    assert rig.loop.wait_for_epoch_plan() == plan
    assert seen == [StartEpoch(plan)] and rig.control.pending_plan is None


def test_the_loop_writes_the_log_lines_the_core_returns() -> None:
    rig = make_rig()
    old, new = EpochPlan(0, 0, 64), EpochPlan(0, 64, 64)
    rig.put(StartEpoch(old), StartEpoch(new))
    with capture_logs() as logs:
        assert rig.loop.handle_control() is False
    (err,) = [e for e in logs if e["log_level"] == "error"]
    assert err["event"] == "one_chunk_in_flight_violated"
    assert err["dropped_plan"] == {"epoch": 0, "partition_offset": 0, "partition_size": 64}
    assert rig.control.pending_plan == new


def test_wait_for_epoch_plan_returns_a_pending_plan_first() -> None:
    rig = make_rig()
    pending = EpochPlan(0, 0, 64)
    rig.control.dispatch(StartEpoch(pending))
    rig.put(StartEpoch(EpochPlan(0, 64, 64)))
    assert rig.loop.wait_for_epoch_plan() == pending
    assert rig.loop.wait_for_epoch_plan() == EpochPlan(0, 64, 64)


def test_wait_for_epoch_plan_services_other_messages_while_idle() -> None:
    rig = make_rig()
    plan = EpochPlan(1, 0, 64)
    rig.put(SyncNow(), SetGlobalStep(3), Throttle(), StartEpoch(plan), SyncNow())
    # The StartEpoch that arrives while throttled lands in the pending slot and is
    # returned once the SyncNow releases the throttle.
    assert rig.loop.wait_for_epoch_plan() == plan
    assert rig.params.names() == ["sync_now", "sync_now"]
    assert [a.step_count for a in rig.of(SyncAck)] == [1, 2]
    assert rig.control.global_step == 3


@pytest.mark.parametrize("ending", ["shutdown", "closed", "shutdown_with_save"])
def test_wait_for_epoch_plan_returns_none_on_shutdown_or_closed_channel(ending: str) -> None:
    rig = make_rig()
    if ending == "shutdown":
        rig.put(Shutdown())
    elif ending == "shutdown_with_save":
        rig.put(ShutdownWithSave(SaveReason.GRACEFUL_SHUTDOWN))
    else:
        rig.inbox.close()
    assert rig.loop.wait_for_epoch_plan() is None


# ------------------------------------------------------------------ training


def test_run_epoch_plan_reports_a_batch_per_step_the_lr_when_news_and_one_metrics() -> None:
    rig = make_rig()
    plan = EpochPlan(0, 0, 10 * BS + 5)  # the sub-batch remainder is dropped
    assert rig.loop.run_epoch_plan(plan) is False
    kinds = [type(m) for m in rig.published]
    # the job's LR is constant: reported after the first step only
    assert kinds == [Batch, LrUpdate] + [Batch] * 9 + [MetricsMsg]
    batches = rig.of(Batch)
    assert [b.step_count for b in batches] == list(range(1, 11))
    assert [b.param_norm is not None for b in batches] == [False] * 9 + [True]
    (metrics,) = rig.of(MetricsMsg)
    assert (metrics.rank, metrics.epoch) == (0, 0)
    assert metrics.batches_processed == 10 and metrics.samples_processed == 10 * BS
    assert metrics.avg_loss == pytest.approx(sum(b.batch_loss for b in batches) / 10)
    assert metrics.compute_only_ms == pytest.approx(sum(b.batch_ms for b in batches))
    assert metrics.data_starve_ms == pytest.approx(sum(b.data_ms for b in batches))
    assert metrics.share_complete_ms == pytest.approx(
        metrics.compute_only_ms + metrics.data_starve_ms
    )
    assert metrics.epoch_ms >= metrics.share_complete_ms
    assert (rig.control.local_step, rig.control.steps_since_avg) == (10, 10)


def test_a_plan_smaller_than_a_batch_reports_all_zero_metrics() -> None:
    rig = make_rig()
    assert rig.loop.run_epoch_plan(EpochPlan(4, 0, BS - 1)) is False
    (metrics,) = rig.published
    assert isinstance(metrics, MetricsMsg)
    assert metrics.epoch == 4 and metrics.batches_processed == 0
    assert metrics.avg_loss == metrics.epoch_ms == metrics.compute_only_ms == 0.0


def test_shutdown_mid_epoch_stops_after_the_current_batch_without_metrics() -> None:
    rig = make_rig()
    rig.put(Shutdown())
    assert rig.loop.run_epoch_plan(EpochPlan(0, 0, EPOCH_SIZE)) is True
    assert [type(m) for m in rig.published] == [Batch, LrUpdate]


def test_extend_partition_mid_plan_is_trained_before_the_plan_completes() -> None:
    rig = make_rig()
    rig.put(ExtendPartition(partition_offset=4 * BS, partition_size=3 * BS))
    rig.loop.run_epoch_plan(EpochPlan(0, 0, 2 * BS))
    (metrics,) = rig.of(MetricsMsg)
    assert metrics.batches_processed == 5
    assert len(rig.of(Batch)) == 5


def test_lr_is_read_at_global_step_plus_steps_since_avg() -> None:
    job = dataclasses.replace(digits.job, lr_at=lambda step: 1e-3 * (1 + step))
    rig = make_rig(job, lr_scale=2.0)
    rig.put(SetGlobalStep(100))
    rig.loop.handle_control()
    rig.loop.run_epoch_plan(EpochPlan(0, 0, 3 * BS))
    expected = [2.0 * 1e-3 * (1 + 100 + k) for k in range(3)]
    assert [u.lr for u in rig.of(LrUpdate)] == pytest.approx(expected)
    assert rig.loop.optimizer.param_groups[0]["lr"] == pytest.approx(expected[-1])


def _two_groups(model: nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    return torch.optim.SGD([{"params": params[:1], "lr": 0.05}, {"params": params[1:], "lr": 0.2}])


def test_a_job_without_a_schedule_trains_at_its_optimizers_own_lr_scaled() -> None:
    """Issue 29: a job that gives no ``lr_at`` trains at what its optimizer says (each
    param group its own), times the run's linear scaling; nothing replaces it with 1e-3."""
    job = dataclasses.replace(digits.job, lr_at=None, build_optimizer=_two_groups)
    rig = make_rig(job, lr_scale=2.0)
    rig.loop.run_epoch_plan(EpochPlan(0, 0, 3 * BS))
    assert [g["lr"] for g in rig.loop.optimizer.param_groups] == pytest.approx([0.1, 0.4])
    assert [u.lr for u in rig.of(LrUpdate)] == pytest.approx([0.1])  # news once


def test_a_resumed_optimizer_is_not_scaled_twice() -> None:
    # The saved state carries the scaled LR; the base is the optimizer as built.
    job = dataclasses.replace(digits.job, lr_at=None, build_optimizer=_two_groups)
    rig = make_rig(job, lr_scale=2.0, base_lrs=[0.05, 0.2])
    for g, loaded in zip(rig.loop.optimizer.param_groups, (0.1, 0.4), strict=True):
        g["lr"] = loaded
    again = RankLoop(
        job=job,
        control=rig.control,
        inbox=rig.inbox,
        publish=rig.published.append,
        model=rig.model,
        optimizer=rig.loop.optimizer,
        train_data=TRAIN,
        lr_scale=2.0,
        base_lrs=[0.05, 0.2],
    )
    assert [g["lr"] for g in again.optimizer.param_groups] == pytest.approx([0.1, 0.4])


def test_the_lr_line_names_its_source_and_the_scaling() -> None:
    from flodl_bus.worker.rank import RankOptions, _lr_line, _lr_said

    own = dataclasses.replace(digits.job, lr_at=None)
    said = _lr_said(own, [0.003], RankOptions(world_size=2, lr_scale=2.0), len(TRAIN))
    assert said == {
        "source": "optimizer",
        "base": 0.003,
        "scale": 2.0,
        "first": 0.006,
        "world_size": 2,
    }
    assert _lr_line(1, said) == (
        "rank 1: learning rate 0.006 (the optimizer's own LR 0.003 x 2, flodl's linear "
        "scaling over 2 ranks; --lr-scale-ratio 0 trains at the job's LR)"
    )
    solo = _lr_said(digits.job, [0.5], RankOptions(), len(TRAIN))
    assert _lr_line(0, solo) == "rank 0: learning rate 0.003 (the job's lr_at/lr_schedule 0.003)"


def test_lr_schedule_is_sized_by_the_runs_epochs_not_the_jobs() -> None:
    seen: list[int] = []

    def schedule(step: int, planned: int) -> float:
        seen.append(planned)
        return 1e-3

    job = dataclasses.replace(digits.job, lr_schedule=schedule)
    make_rig(job, planned_epochs=7).loop.run_epoch_plan(EpochPlan(0, 0, 2 * BS))
    make_rig(job).loop.run_epoch_plan(EpochPlan(0, 0, 2 * BS))
    per_epoch = EPOCH_SIZE // BS
    assert seen == [7 * per_epoch] * 2 + [job.num_epochs * per_epoch] * 2


def test_record_scalar_is_aggregated_per_plan_into_the_metrics() -> None:
    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        record_scalar("batch_rows", float(len(batch[0])))
        return classification_loss(model, batch)

    rig = make_rig(dataclasses.replace(digits.job, loss_fn=loss_fn))
    rig.loop.run_epoch_plan(EpochPlan(0, 0, 4 * BS))
    rig.loop.run_epoch_plan(EpochPlan(1, 0, 2 * BS))
    first, second = rig.of(MetricsMsg)
    assert first.scalars == {"batch_rows": (4.0 * BS, 4)}
    assert second.scalars == {"batch_rows": (2.0 * BS, 2)}


def test_the_metrics_totals_add_left_to_right_on_every_python() -> None:
    # Python 3.12's sum() of floats is compensated, 3.11's is not; a coordinator replay
    # reads these totals from the rank's MetricsMsg, so they must have one value. Here the
    # plain left-to-right sum is 0.999...9 and the compensated one 2.0.
    values = [1e16, 1.0, -1e16] + [0.1] * 10
    plain = functools.reduce(operator.add, values, 0)
    assert plain != math.fsum(values)
    script = iter(values)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        value = next(script)
        record_scalar("v", value)
        # The scripted value in float64 (exact), with the model's graph for backward.
        return (classification_loss(model, batch) * 0.0).double() + value

    rig = make_rig(dataclasses.replace(digits.job, loss_fn=loss_fn))
    rig.loop.run_epoch_plan(EpochPlan(0, 0, len(values) * BS))
    batches = rig.of(Batch)
    (metrics,) = rig.of(MetricsMsg)
    assert [b.batch_loss for b in batches] == values
    assert metrics.avg_loss == plain / len(values)
    assert metrics.scalars == {"v": (plain, len(values))}
    ms = [b.batch_ms for b in batches], [b.data_ms for b in batches]
    assert metrics.compute_only_ms == functools.reduce(operator.add, ms[0], 0)
    assert metrics.data_starve_ms == functools.reduce(operator.add, ms[1], 0)


def test_three_plans_give_three_metrics_for_epochs_0_1_2_then_exiting() -> None:
    rig = make_rig(
        after_metrics=[
            [StartEpoch(EpochPlan(1, 0, EPOCH_SIZE))],
            [StartEpoch(EpochPlan(2, 0, EPOCH_SIZE))],
            [Shutdown()],
        ]
    )
    rig.put(StartEpoch(EpochPlan(0, 0, EPOCH_SIZE)))
    assert rig.loop.run_until_shutdown() is True
    metrics = rig.of(MetricsMsg)
    assert [m.epoch for m in metrics] == [0, 1, 2]
    assert all(m.batches_processed == EPOCH_SIZE // BS for m in metrics)
    assert rig.published[-1] == Exiting(rank=0)
    # Training works: the loss falls epoch over epoch on the real data.
    losses = [m.avg_loss for m in metrics]
    assert losses[0] > losses[1] > losses[2]
    assert losses[2] < 0.5 * losses[0]


class DigitRows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The digits as a map-style torch Dataset: one sample per ``__getitem__``."""

    def __len__(self) -> int:
        return len(TRAIN)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return TRAIN.x[i], TRAIN.y[i]


def _train_two_epochs(feed: Feed) -> tuple[nn.Module, list[float]]:
    """Two epochs, the first grown by ExtendPartition mid-plan, through ``feed``."""
    rig = make_rig(
        feed=feed,
        after_metrics=[[StartEpoch(EpochPlan(1, 0, EPOCH_SIZE))], [Shutdown()]],
    )
    rig.put(StartEpoch(EpochPlan(0, 0, EPOCH_SIZE // 2)), ExtendPartition(EPOCH_SIZE // 2, 300))
    assert rig.loop.run_until_shutdown() is True
    return rig.model, [b.batch_loss for b in rig.of(Batch)]


def _identical(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def test_prefetch_trains_bit_identically_to_the_gather_on_the_training_thread() -> None:
    plain, plain_losses = _train_two_epochs(ArrayFeed(TRAIN, CPU, prefetch=False))
    ahead = ArrayFeed(TRAIN, CPU, prefetch=True)
    model, losses = _train_two_epochs(ahead)
    # Every batch of the grown first plan and of the second, in the same order.
    assert losses == plain_losses
    assert len(losses) == (EPOCH_SIZE // 2 + 300) // BS + EPOCH_SIZE // BS
    assert _identical(model, plain)
    assert ahead.hits > 0.9 * len(losses)  # the batches really came from the prefetch


def test_a_torch_dataset_loaded_by_data_loader_workers_trains_the_same_model() -> None:
    arrays, array_losses = _train_two_epochs(ArrayFeed(TRAIN, CPU, prefetch=False))
    model, losses = _train_two_epochs(LoaderFeed(DigitRows(), CPU, workers=2, seed=1))
    assert losses == array_losses
    assert _identical(model, arrays)
    # A real model learned from it: the second epoch's loss is well below the first's.
    half = len(losses) // 2
    assert sum(losses[half:]) < 0.7 * sum(losses[:half])


def test_epoch_fn_fires_once_per_epoch_on_the_role_rank_only() -> None:
    fired: list[tuple[int, int]] = []
    for rank in (0, 1):
        rig = make_rig(
            rank=rank,
            epoch_fn=lambda e, r=rank: fired.append((r, e)),
            # The second chunk of epoch 0 must not fire again.
            after_metrics=[
                [StartEpoch(EpochPlan(0, BS, BS))],
                [StartEpoch(EpochPlan(1, 0, BS))],
                [Shutdown()],
            ],
        )
        rig.put(SetEpochCallbackRole(1), StartEpoch(EpochPlan(0, 0, BS)))
        assert rig.loop.run_until_shutdown()
        elapsed = rig.of(EpochFnElapsed)
        assert [e.epoch for e in elapsed] == ([0, 1] if rank == 1 else [])
    assert fired == [(1, 0), (1, 1)]


def test_a_training_failure_aborts_the_params_and_says_why_upstream() -> None:
    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        raise RuntimeError("CUDA error: device-side assert")

    snapshots: list[int] = []
    rig = make_rig(
        dataclasses.replace(digits.job, loss_fn=loss_fn), final_snapshot=lambda: snapshots.append(1)
    )
    rig.put(StartEpoch(EpochPlan(0, 0, EPOCH_SIZE)))
    with pytest.raises(JobError, match=r"^loss_fn raised RuntimeError: CUDA error: device-side"):
        rig.loop.run_until_shutdown()
    # Not a completion: an Exiting whose reason makes the coordinator stop the run.
    assert rig.of(Exiting) == [
        Exiting(0, reason="job_failed: loss_fn raised RuntimeError: CUDA error: device-side assert")
    ]
    assert rig.params.names() == ["abort"]
    assert snapshots == [1]


def test_a_bug_outside_the_job_is_a_rank_failure_not_a_job_failure() -> None:
    rig = make_rig()

    def broken(*_a: object) -> None:
        raise OSError("disk gone")

    rig.loop.publish = lambda msg: (
        broken() if isinstance(msg, MetricsMsg) else rig.published.append(msg)
    )
    rig.put(StartEpoch(EpochPlan(0, 0, EPOCH_SIZE)))
    with pytest.raises(OSError):
        rig.loop.run_until_shutdown()
    assert rig.loop.failure == "rank_failed: OSError: disk gone"
    assert rig.of(Exiting) == [Exiting(0, reason="rank_failed: OSError: disk gone")]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_loss_stops_before_the_step_by_default(bad: float) -> None:
    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return classification_loss(model, batch) * bad

    rig = make_rig(dataclasses.replace(digits.job, loss_fn=loss_fn))
    before = [p.detach().clone() for p in rig.model.parameters()]
    rig.put(StartEpoch(EpochPlan(0, 0, EPOCH_SIZE)))
    with pytest.raises(JobError, match="non-finite loss"):
        rig.loop.run_until_shutdown()
    # The bad loss never reached the parameters (a save on the way out keeps them sound).
    assert all(torch.equal(a, b) for a, b in zip(before, rig.model.parameters()))
    (exiting,) = rig.of(Exiting)
    assert exiting.reason is not None and exiting.reason.startswith("job_failed: loss_fn returned")


def test_a_non_finite_loss_is_skipped_when_the_job_says_so() -> None:
    calls = [0]

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        calls[0] += 1
        loss = classification_loss(model, batch)
        return loss * math.nan if calls[0] % 2 == 0 else loss  # every other batch

    job = dataclasses.replace(digits.job, loss_fn=loss_fn, on_nonfinite_loss="skip")
    rig = make_rig(job, after_metrics=[[Shutdown()]])
    rig.put(StartEpoch(EpochPlan(0, 0, EPOCH_SIZE)))
    assert rig.loop.run_until_shutdown() is True
    n = EPOCH_SIZE // job.batch_size
    (metrics,) = rig.of(MetricsMsg)
    # Every batch is reported (its samples were seen), half of them skipped.
    assert metrics.batches_processed == n and len(rig.of(Batch)) == n
    assert metrics.scalars["nonfinite_skipped"] == (float(n // 2), n // 2)
    assert math.isfinite(metrics.avg_loss)
    assert all(bool(torch.isfinite(p).all()) for p in rig.model.parameters())
    assert rig.of(Exiting) == [Exiting(0)]


def test_teardown_writes_a_queued_shutdown_with_save_bundle(tmp_path: Any) -> None:
    from flodl_bus.worker.model_port import TorchModelPort

    rig = make_rig()
    rig.control.model = TorchModelPort(rank=0, model=rig.model, save_path=str(tmp_path / "s"))
    rig.put(Shutdown(), ShutdownWithSave(SaveReason.MAX_FAILURE_EXCEEDED), SetGlobalStep(1))
    assert rig.loop.run_until_shutdown() is True
    assert (tmp_path / "s.model.pt").exists()
    assert rig.published == [Exiting(rank=0)]


def test_a_failure_found_off_the_training_thread_is_said_upstream_at_teardown() -> None:
    why = "averaging_failed: averaging round 2: RuntimeError('no new session')"
    rig = make_rig(failure_of=lambda: why)
    # The averager injects Shutdown when its round failed for good.
    rig.put(Shutdown())
    assert rig.loop.run_until_shutdown() is True
    assert rig.of(Exiting) == [Exiting(0, reason=why)]
    assert rig.loop.failure == why


def test_an_eval_that_fails_is_reported_and_logged_and_training_goes_on() -> None:
    """flodl's rule (issue 29): a failed eval does not stop the run."""
    from flodl_bus.protocol.messages import EvalResult, ExecuteEvalCallback, Shutdown

    class Raising:
        """A model port whose eval_fn raises (the job's bug)."""

        has_eval_fn = has_eval_dataset = True
        has_checkpoint_fn = has_save_path = False

        def eval_mode(self) -> None: ...

        def train_mode(self) -> None: ...

        def evaluate(self) -> float:
            raise RuntimeError("the eval set is gone")

    rig = make_rig(after_metrics=[[Shutdown()]])  # the plan done, the run ends
    rig.control.model = Raising()  # type: ignore[assignment]
    rig.inbox.put(ExecuteEvalCallback(schedule_id=3, epoch=3, target_rank=0))
    rig.inbox.put(StartEpoch(EpochPlan(0, 0, 4 * BS)))
    with capture_logs() as logs:
        assert rig.loop.run_until_shutdown() is True
    (result,) = rig.of(EvalResult)
    assert result.error is not None and "the eval set is gone" in result.error
    failed = [e for e in logs if e["event"] == "eval_failed"]
    assert len(failed) == 1 and failed[0]["epoch"] == 3 and failed[0]["log_level"] == "error"
    assert len(rig.of(Batch)) == 4 and len(rig.of(MetricsMsg)) == 1  # it trained on


def test_every_plans_metrics_carry_the_ranks_own_rss_and_no_gpu_on_cpu() -> None:
    from tests.worker.test_resources import vm_rss

    rig = make_rig()
    rig.loop.run_epoch_plan(EpochPlan(0, 0, 3 * BS))
    rig.loop.run_epoch_plan(EpochPlan(1, 0, BS - 1))  # the zero-batch report too
    mine = vm_rss("self")
    for metrics in rig.of(MetricsMsg):
        res = metrics.resources
        assert res is not None and res.rss_bytes is not None
        # this process's RSS (the rig trains in it), give or take what moved since
        assert abs(res.rss_bytes - mine) < 64 * 2**20, (res.rss_bytes, mine)
        assert res.device_index is None and res.vram_allocated_bytes is None
