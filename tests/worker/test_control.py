"""WorkerControl and the reader's ``route``, rule by rule, without torch (the sans-IO
promise: the core's ports here are plain Python). ``test_control_torch.py`` drives the same
core through the torch-backed ports of a real rank."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_bus.params.port import SyncResult
from flodl_bus.partition import SHUFFLE_BASE_SEED, make_partition
from flodl_bus.protocol import wire
from flodl_bus.protocol.messages import (
    ArmConsensusEval,
    ArmEpochEval,
    AveragedParams,
    Batch,
    Checkpoint,
    CheckpointResult,
    ControlMsg,
    CoordHeartbeat,
    DeclareDead,
    EpochPlan,
    EvalResult,
    ExecuteEvalCallback,
    ExtendPartition,
    LrUpdate,
    NewNcclSession,
    RequestNewNcclId,
    RequestParams,
    SaveConsensusModel,
    SaveReason,
    SetGlobalStep,
    Shutdown,
    ShutdownWithSave,
    StartEpoch,
    SyncAck,
    SyncNow,
    Throttle,
    Update,
    WireUpdate,
    is_control_wire,
)
from flodl_bus.worker.control import (
    PARAM_NORM_EVERY,
    DeclaredDead,
    Deliver,
    Dispatched,
    JoinSession,
    Log,
    MakeSessionId,
    PeerDead,
    Phase,
    WorkerControl,
    acts_at_teardown,
    route,
)
from tests.protocol.strategies import STRATEGIES, same

ROOT = Path(__file__).resolve().parents[2]
PICK_SPACE = 1000
#: set in the subprocess that reruns this module with torch unimportable
NO_TORCH_RUN = "FLODL_TEST_CONTROL_WITHOUT_TORCH"


# ----------------------------------------------------------------------- ports


class ListParams:
    """A ParamPort in plain Python: fixed answers, every call noted."""

    def __init__(self) -> None:
        self.sync = SyncResult(0.5, 2.0, 3.0)
        self.norm = 4.0
        self.calls: list[tuple[str, Any]] = []

    def sync_now(self, steps_since_avg: int) -> SyncResult:
        self.calls.append(("sync_now", steps_since_avg))
        return self.sync

    def snapshot(self, steps_since_avg: int) -> None:
        self.calls.append(("snapshot", steps_since_avg))

    def load_averaged(self, avg: AveragedParams) -> None:
        self.calls.append(("load_averaged", avg.version))

    def param_norm(self) -> float:
        self.calls.append(("param_norm", None))
        return self.norm

    def abort(self) -> None:
        self.calls.append(("abort", None))

    def new_session(self, uid: bytes, new_rank: int, new_world_size: int) -> None:
        self.calls.append(("new_session", (new_rank, new_world_size)))


@dataclass
class ListModel:
    """A ModelPort in plain Python: what it can do, what it answers, every call noted."""

    has_checkpoint_fn: bool = True
    has_eval_fn: bool = True
    has_eval_dataset: bool = True
    has_save_path: bool = True
    metric: float = 0.75
    raises: dict[str, Exception] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.raises:
            raise self.raises[name]

    def checkpoint(self, version: int) -> None:
        self._call(f"checkpoint {version}")

    def eval_mode(self) -> None:
        self._call("eval_mode")

    def train_mode(self) -> None:
        self._call("train_mode")

    def evaluate(self) -> float:
        self._call("evaluate")
        return self.metric

    def evaluate_consensus(self) -> float:
        self._call("evaluate_consensus")
        return self.metric

    def save_bundle(self, reason: SaveReason) -> None:
        self._call(f"save_bundle {reason.snake}")

    def save_consensus(self) -> None:
        self._call("save_consensus")

    def save_rank_state(self) -> None:
        self._call("save_rank_state")


class StepClock:
    """Every reading advances by ``step`` seconds."""

    def __init__(self, step: float = 0.25) -> None:
        self.now, self.step = 100.0, step

    def __call__(self) -> float:
        t, self.now = self.now, self.now + self.step
        return t


@dataclass
class Rank:
    control: WorkerControl
    params: ListParams
    model: ListModel

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.control.step_done(1.0, 1.0, 0.0, 0.1)


def make(
    rank: int = 0, batch_size: int = 32, plans_wait_for_update: bool = False, **model: Any
) -> Rank:
    params, port = ListParams(), ListModel(**model)
    control = WorkerControl(
        rank=rank,
        params=params,
        batch_size=batch_size,
        pick_space=PICK_SPACE,
        clock=StepClock(),
        model=port,
        plans_wait_for_update=plans_wait_for_update,
    )
    return Rank(control, params, port)


def update(version: int, realized: bool = True) -> Update:
    return Update(AveragedParams(params=(), buffers=(), version=version, realized=realized))


# -------------------------------------------------------------------- sans-IO


def test_the_core_module_imports_no_torch_no_transport_and_no_logger() -> None:
    code = (
        "import sys\n"
        "for name in ('torch', 'redis', 'structlog'):\n"
        "    sys.modules[name] = None\n"
        "import flodl_bus.worker.control as c\n"
        "assert 'time' not in vars(c) and 'structlog' not in vars(c)\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.skipif(NO_TORCH_RUN in os.environ, reason="this is the run without torch")
def test_these_unit_tests_pass_with_torch_unimportable() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import pytest\n"
        f"rc = pytest.main(['-q', '-p', 'no:cacheprovider', {__file__!r}])\n"
        "assert 'torch' not in sys.modules or sys.modules['torch'] is None\n"
        "sys.exit(rc)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    env[NO_TORCH_RUN] = "1"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


# --------------------------------------------------------------------- routing


@pytest.mark.parametrize("name", sorted(wire.CONTROL_TYPES))
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_route_decides_every_control_type_off_the_wire(name: str, data: st.DataObject) -> None:
    msg = wire.decode_control(wire.encode(data.draw(STRATEGIES[name])))
    assert is_control_wire(msg)  # the reader's typed boundary lets every one through
    rank = data.draw(st.integers(min_value=0, max_value=3))
    routed = route(msg, rank)
    if isinstance(msg, CoordHeartbeat):
        assert routed is None
    elif isinstance(msg, WireUpdate):
        if msg.next_plan is None:
            assert routed is None
        else:
            assert routed == Deliver(StartEpoch(msg.next_plan))
    elif isinstance(msg, DeclareDead):
        assert routed == (DeclaredDead() if msg.rank == rank else PeerDead(msg.rank))
    elif isinstance(msg, RequestNewNcclId):
        assert routed == MakeSessionId()
    elif isinstance(msg, NewNcclSession):
        assert isinstance(routed, JoinSession) and routed.session is msg
    else:
        assert isinstance(routed, Deliver) and same(routed.msg, msg)
        assert routed.ends_run == isinstance(msg, (Shutdown, ShutdownWithSave))


def test_what_is_not_control_wire_fails_the_readers_typed_boundary() -> None:
    for other in (update(1), SyncAck(rank=0, step_count=1), Batch(0, 1.0, 0.0, 1, 0.5), object()):
        assert not is_control_wire(other)


def test_route_passes_the_same_object_to_the_core() -> None:
    msg = StartEpoch(EpochPlan(1, 2, 3))
    routed = route(msg, 0)
    assert isinstance(routed, Deliver) and routed.msg is msg


def test_route_and_dispatch_refuse_what_is_not_a_control_message() -> None:
    with pytest.raises(AssertionError):
        route(SyncAck(rank=0, step_count=1), 0)  # type: ignore[arg-type]
    with pytest.raises(AssertionError):
        make().control.dispatch(SyncAck(rank=0, step_count=1))  # type: ignore[arg-type]


# ---------------------------------------------------------------------- phases


def test_a_rank_starts_running_and_a_throttle_pauses_it_until_a_release() -> None:
    r = make()
    assert r.control.phase is Phase.RUNNING
    assert r.control.dispatch(Throttle()) == Dispatched(throttled=True)
    assert r.control.phase is Phase.THROTTLED and r.control.throttled
    assert r.control.dispatch(SetGlobalStep(3)) == Dispatched(throttled=True)
    assert r.control.dispatch(Throttle()) == Dispatched(throttled=True)  # never nests
    out = r.control.dispatch(SyncNow())
    assert not out.throttled and r.control.phase is Phase.RUNNING


@pytest.mark.parametrize("release", ["SyncNow", "Update", "Shutdown", "ShutdownWithSave"])
def test_each_release_ends_the_throttle(release: str) -> None:
    r = make()
    r.control.dispatch(Throttle())
    msg: ControlMsg = {
        "SyncNow": SyncNow(),
        "Update": update(1),
        "Shutdown": Shutdown(),
        "ShutdownWithSave": ShutdownWithSave(SaveReason.REDUCE_STALL),
    }[release]
    out = r.control.dispatch(msg)
    assert not out.throttled
    stops = release.startswith("Shutdown")
    assert out.stop == stops
    assert r.control.phase is (Phase.STOPPED if stops else Phase.RUNNING)


def test_a_throttled_rank_services_rounds_and_plans_without_releasing() -> None:
    r = make()
    r.control.dispatch(Throttle())
    r.steps(4)
    assert r.control.dispatch(RequestParams()).throttled
    plan = EpochPlan(0, 0, 32)
    assert r.control.dispatch(StartEpoch(plan)).throttled
    assert r.params.calls == [("snapshot", 4)] and r.control.pending_plan == plan
    assert r.control.state()["throttled"] is True


def test_a_stop_is_final_and_a_late_throttle_does_not_pause_a_stopped_rank() -> None:
    r = make()
    assert r.control.dispatch(Shutdown()) == Dispatched(stop=True)
    assert r.control.phase is Phase.STOPPED
    assert r.control.dispatch(Throttle()).stop
    assert r.control.phase is Phase.STOPPED and not r.control.throttled
    # The teardown's queued save is still acted on.
    assert r.control.dispatch(ShutdownWithSave(SaveReason.GRACEFUL_SHUTDOWN)).stop
    assert r.model.calls == ["save_bundle graceful_shutdown"]


def test_a_closed_channel_stops_a_throttled_rank() -> None:
    r = make()
    r.control.dispatch(Throttle())
    assert r.control.channel_closed() == Dispatched(stop=True)
    assert r.control.phase is Phase.STOPPED and not r.control.throttled


def test_teardown_acts_only_on_a_shutdown() -> None:
    assert acts_at_teardown(Shutdown())
    assert acts_at_teardown(ShutdownWithSave(SaveReason.GRACEFUL_SHUTDOWN))
    for msg in (SyncNow(), Throttle(), RequestParams(), StartEpoch(EpochPlan(0, 0, 1))):
        assert not acts_at_teardown(msg)


# ----------------------------------------------------------------------- plans


def test_a_plan_waits_in_the_one_slot_mailbox_until_taken() -> None:
    r = make()
    assert r.control.take_pending_plan() is None
    plan = EpochPlan(1, 0, 64)
    assert r.control.dispatch(StartEpoch(plan)) == Dispatched()
    assert r.control.state()["pending_plan"] == {
        "epoch": 1,
        "partition_offset": 0,
        "partition_size": 64,
    }
    assert r.control.take_pending_plan() == plan
    assert r.control.take_pending_plan() is None


def test_overwriting_an_unconsumed_plan_returns_an_error_line_and_keeps_the_newer() -> None:
    r = make(rank=2)
    old, new = EpochPlan(1, 0, 64), EpochPlan(1, 64, 32)
    r.control.dispatch(StartEpoch(old))
    out = r.control.dispatch(StartEpoch(new))
    assert (out.upstream, out.stop, out.throttled) == ((), False, False)
    (line,) = out.logs
    assert (line.level, line.event) == ("error", "one_chunk_in_flight_violated")
    assert line.fields["rank"] == 2
    assert line.fields["dropped_plan"] == {"epoch": 1, "partition_offset": 0, "partition_size": 64}
    assert line.fields["kept_plan"] == {"epoch": 1, "partition_offset": 64, "partition_size": 32}
    assert r.control.pending_plan == new


def test_begin_plan_and_extend_partition_use_one_permutation_of_the_epoch() -> None:
    r = make()
    r.control.begin_plan(EpochPlan(epoch=3, partition_offset=100, partition_size=64))
    assert r.control.num_batches == 2
    r.control.dispatch(ExtendPartition(partition_offset=500, partition_size=40))
    expected = make_partition(100, 64, PICK_SPACE, 3, SHUFFLE_BASE_SEED) + make_partition(
        500, 40, PICK_SPACE, 3, SHUFFLE_BASE_SEED
    )
    assert r.control.partition == expected
    assert r.control.num_batches == 104 // 32
    assert r.control.batch_picks(1) == expected[32:64]
    assert r.control.partition[64:] != make_partition(500, 40, PICK_SPACE, 4, SHUFFLE_BASE_SEED)


# -------------------------------------------------------------- step accounting


def test_a_round_ships_the_steps_at_snapshot_and_keeps_those_taken_since() -> None:
    r = make()
    r.steps(5)
    assert r.control.dispatch(RequestParams()) == Dispatched()
    assert r.params.calls == [("snapshot", 5)] and r.control.steps_at_snapshot == 5
    r.steps(3)
    r.control.dispatch(update(7))
    assert (r.control.steps_since_avg, r.control.steps_at_snapshot) == (3, 0)
    assert r.control.current_version == 7 and r.control.local_step == 8
    r.control.dispatch(update(7))  # a duplicate subtracts nothing
    assert r.control.steps_since_avg == 3
    assert [c for c, _ in r.params.calls].count("load_averaged") == 2


def test_the_subtraction_saturates_at_zero() -> None:
    r = make()
    r.steps(4)
    r.control.dispatch(RequestParams())
    r.control.steps_since_avg = 1
    r.control.dispatch(update(1))
    assert r.control.steps_since_avg == 0


def test_sync_now_zeroes_the_counters_bumps_local_step_and_acks_with_the_triple() -> None:
    r = make(rank=1)
    r.steps(6)
    r.control.dispatch(RequestParams())
    r.steps(1)
    out = r.control.dispatch(SyncNow())
    assert r.params.calls[-1] == ("sync_now", 7)
    assert (r.control.steps_since_avg, r.control.steps_at_snapshot) == (0, 0)
    assert out == Dispatched(
        upstream=(SyncAck(rank=1, step_count=8, divergence=0.5, post_norm=2.0, pre_norm=3.0),)
    )


def test_step_done_reports_a_batch_and_an_lr_with_a_norm_every_tenth_step() -> None:
    r = make()
    reports = [r.control.step_done(0.5, 2.0, 0.25, 0.01) for _ in range(2 * PARAM_NORM_EVERY)]
    assert [i + 1 for i, (b, _) in enumerate(reports) if b.param_norm is not None] == [10, 20]
    assert reports[9][0].param_norm == 4.0
    assert reports[0] == (
        Batch(rank=0, batch_ms=2.0, data_ms=0.25, step_count=1, batch_loss=0.5, param_norm=None),
        LrUpdate(rank=0, lr=0.01),
    )
    r.control.dispatch(SyncNow())  # local_step 21, steps_since_avg 0
    later = [r.control.step_done(0.5, 1.0, 0.0, 0.1) for _ in range(PARAM_NORM_EVERY)]
    assert [b.step_count for b, _ in later if b.param_norm is not None] == [31]


def test_the_lr_is_reported_when_it_is_news_and_after_every_step_for_older_records() -> None:
    r = make()
    lrs = [0.01, 0.01, 0.01, 0.02, 0.02, 0.01]
    sent = [r.control.step_done(0.5, 1.0, 0.0, lr)[1] for lr in lrs]
    assert sent == [
        LrUpdate(rank=0, lr=0.01),
        None,
        None,
        LrUpdate(rank=0, lr=0.02),
        None,
        LrUpdate(rank=0, lr=0.01),
    ]
    every = make()
    every.control.lr_every_step = True
    assert all(every.control.step_done(0.5, 1.0, 0.0, lr)[1] is not None for lr in lrs)


def test_the_lr_is_read_at_global_step_plus_steps_since_avg() -> None:
    r = make()
    r.control.dispatch(SetGlobalStep(100))
    r.steps(3)
    assert r.control.lr_position == 103


# ------------------------------------------------------------------ targeting


def test_a_checkpoint_on_its_target_reports_its_elapsed_time_or_its_error() -> None:
    r = make(rank=1)
    out = r.control.dispatch(Checkpoint(version=4, target_rank=1))
    assert out.upstream == (CheckpointResult(rank=1, version=4, elapsed_ms=250.0, error=None),)
    assert r.control.dispatch(Checkpoint(version=5, target_rank=0)) == Dispatched()
    assert r.model.calls == ["checkpoint 4"]
    failing = make(raises={"checkpoint 1": OSError("disk full")})
    (result,) = failing.control.dispatch(Checkpoint(version=1, target_rank=0)).upstream
    assert isinstance(result, CheckpointResult) and result.error == "OSError: disk full"
    absent = make(rank=2, has_checkpoint_fn=False)
    (result,) = absent.control.dispatch(Checkpoint(version=1, target_rank=2)).upstream
    assert isinstance(result, CheckpointResult) and result.error is not None
    assert "checkpoint_fn" in result.error and "rank 2" in result.error


def test_an_eval_flips_to_eval_mode_and_always_back() -> None:
    r = make(rank=1)
    (result,) = r.control.dispatch(ExecuteEvalCallback(3, 3, target_rank=1)).upstream
    assert r.model.calls == ["eval_mode", "evaluate", "train_mode"]
    assert result == EvalResult(
        rank=1, schedule_id=3, epoch=3, metric=0.75, elapsed_ms=250.0, error=None
    )
    bad = make(raises={"evaluate": RuntimeError("bad eval")})
    (result,) = bad.control.dispatch(ExecuteEvalCallback(1, 1, target_rank=0)).upstream
    assert isinstance(result, EvalResult) and math.isnan(result.metric)
    assert result.error == "RuntimeError: bad eval"
    assert bad.model.calls == ["eval_mode", "evaluate", "train_mode"]


def test_an_eval_without_a_dataset_reports_an_error_and_touches_no_mode() -> None:
    r = make(has_eval_dataset=False)
    (result,) = r.control.dispatch(ExecuteEvalCallback(1, 1, target_rank=0)).upstream
    assert isinstance(result, EvalResult) and math.isnan(result.metric)
    assert result.error is not None and "eval dataset" in result.error
    assert r.model.calls == []


def test_an_eval_for_another_rank_or_without_an_eval_fn_is_silent() -> None:
    r = make()
    assert r.control.dispatch(ExecuteEvalCallback(1, 1, target_rank=1)) == Dispatched()
    no_fn = make(has_eval_fn=False)
    assert no_fn.control.dispatch(ExecuteEvalCallback(1, 1, target_rank=0)) == Dispatched()
    assert r.model.calls == no_fn.model.calls == []


def test_an_armed_eval_scores_the_next_realized_consensus_once() -> None:
    r = make()
    r.control.dispatch(ArmConsensusEval(schedule_id=5, epoch=2, target_rank=1))
    assert r.control.pending_consensus_eval is None
    r.control.dispatch(ArmConsensusEval(schedule_id=4, epoch=4, target_rank=0))
    assert r.control.dispatch(update(1, realized=False)) == Dispatched()
    assert r.control.pending_consensus_eval == (4, 4)
    (result,) = r.control.dispatch(update(2)).upstream
    assert isinstance(result, EvalResult) and (result.schedule_id, result.epoch) == (4, 4)
    assert r.control.pending_consensus_eval is None
    assert r.control.dispatch(update(3)) == Dispatched()
    # Scored as the consensus (under cpu-async the adopted model is a blend, not it).
    assert r.model.calls.count("evaluate_consensus") == 1
    assert "evaluate" not in r.model.calls


def test_an_epoch_eval_armed_ahead_is_due_at_its_epochs_first_plan_and_served_once() -> None:
    r = make()
    r.control.dispatch(ArmEpochEval(schedule_id=3, epoch=3, target_rank=1))
    assert r.control.pending_epoch_eval is None  # another rank's
    assert r.control.dispatch(ArmEpochEval(schedule_id=3, epoch=3, target_rank=0)) == Dispatched()
    assert r.model.calls == []  # armed, not run: the rank still trains epoch 2
    assert r.control.eval_due() is None  # no plan to take yet
    r.control.dispatch(StartEpoch(EpochPlan(2, 0, 8)))
    assert r.control.eval_due() is None  # the plan to take is still epoch 2's
    r.control.take_pending_plan()
    r.control.dispatch(StartEpoch(EpochPlan(3, 0, 8)))
    due = r.control.eval_due()
    assert due == ExecuteEvalCallback(3, 3, target_rank=0)
    (result,) = r.control.dispatch(due).upstream
    assert isinstance(result, EvalResult) and (result.schedule_id, result.epoch) == (3, 3)
    assert r.model.calls == ["eval_mode", "evaluate", "train_mode"]  # the live model
    assert r.control.eval_due() is None  # served: never twice


def test_an_eval_scores_the_consensus_or_the_live_model_as_its_message_says() -> None:
    r = make()
    r.control.dispatch(ExecuteEvalCallback(1, 1, target_rank=0, adopt_consensus=True))
    r.control.dispatch(ExecuteEvalCallback(2, 2, target_rank=0, adopt_consensus=False))
    assert r.model.calls == [
        "eval_mode",
        "evaluate_consensus",
        "train_mode",
        "eval_mode",
        "evaluate",
        "train_mode",
    ]


# ------------------------------------------------------------ saves, log lines


def test_saves_without_a_save_path_return_a_warning_and_go_on() -> None:
    r = make(has_save_path=False)
    out = r.control.dispatch(SaveConsensusModel(target_rank=0))
    assert out == Dispatched(logs=(out.logs[0],)) and out.logs[0].level == "warning"
    assert out.logs[0].event == "save_consensus_without_save_path"
    out = r.control.dispatch(ShutdownWithSave(SaveReason.GRACEFUL_SHUTDOWN))
    assert out.stop and [line.event for line in out.logs] == [
        "shutdown_with_save_without_save_path"
    ]
    assert out.logs[0].fields["reason"] == "graceful_shutdown"
    assert r.model.calls == []


def test_failed_saves_return_an_error_line_and_never_raise() -> None:
    r = make(
        raises={
            "save_consensus": OSError("read-only"),
            "save_bundle single_survivor": OSError("full"),
        }
    )
    out = r.control.dispatch(SaveConsensusModel(target_rank=0))
    assert out.logs == (
        Log("error", "save_consensus_failed", {"rank": 0, "error": "OSError: read-only"}),
    )
    out = r.control.dispatch(ShutdownWithSave(SaveReason.SINGLE_SURVIVOR))
    assert out.stop and out.logs == (
        Log(
            "error",
            "checkpoint_bundle_failed",
            {"rank": 0, "reason": "single_survivor", "error": "OSError: full"},
        ),
    )


def test_a_save_writes_the_model_on_its_target_and_each_ranks_own_state_everywhere() -> None:
    r = make()
    assert r.control.dispatch(SaveConsensusModel(target_rank=1)) == Dispatched()
    assert r.model.calls == ["save_rank_state"]
    assert r.control.dispatch(SaveConsensusModel(target_rank=0)) == Dispatched()
    assert r.model.calls == ["save_rank_state", "save_consensus", "save_rank_state"]


def test_a_failed_rank_state_save_is_one_error_line_and_never_raises() -> None:
    r = make(raises={"save_rank_state": OSError("disk full")})
    out = r.control.dispatch(SaveConsensusModel(target_rank=1))
    assert out.logs == (
        Log("error", "rank_state_not_saved", {"rank": 0, "error": "OSError: disk full"}),
    )


def test_a_port_failure_propagates_out_of_dispatch() -> None:
    class Broken(ListParams):
        def sync_now(self, steps_since_avg: int) -> SyncResult:
            raise RuntimeError("peer gone")

    r = make()
    r.control.params = Broken()
    with pytest.raises(RuntimeError, match="peer gone"):
        r.control.dispatch(SyncNow())


def test_the_same_messages_into_a_fresh_core_give_the_same_effects() -> None:
    def run() -> tuple[list[Dispatched], dict[str, object]]:
        r = make()
        script: list[ControlMsg] = [
            SetGlobalStep(10),
            StartEpoch(EpochPlan(0, 0, 64)),
            StartEpoch(EpochPlan(0, 64, 64)),
            Throttle(),
            RequestParams(),
            SyncNow(),
            Checkpoint(1, 0),
            ExtendPartition(64, 32),
            ShutdownWithSave(SaveReason.GRACEFUL_SHUTDOWN),
        ]
        outs = []
        for i, msg in enumerate(script):
            r.steps(i)
            outs.append(r.control.dispatch(msg))
        return outs, r.control.state()

    assert run() == run()


@pytest.mark.parametrize("waits", [True, False])
def test_a_plan_sent_behind_request_params_waits_for_the_rounds_update(waits: bool) -> None:
    # cpu-cadence (issue 27): the next plan follows RequestParams at once, but adoption
    # overwrites the parameters, so a step before the Update would be lost.
    r = make(plans_wait_for_update=waits)
    r.control.dispatch(StartEpoch(EpochPlan(0, 0, 64)))
    r.control.begin_plan(r.control.take_pending_plan() or EpochPlan(0, 0, 0))
    r.steps(2)
    r.control.dispatch(RequestParams())
    nxt = EpochPlan(0, 64, 64)
    r.control.dispatch(StartEpoch(nxt))
    if waits:
        assert r.control.take_pending_plan() is None
        assert r.control.pending_plan == nxt  # held, not dropped
        r.control.dispatch(update(1))
    assert r.control.take_pending_plan() == nxt
