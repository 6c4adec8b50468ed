"""``lockstep``: a schedule no timing can change (one batch per rank per window, the
next plan only after the window's average, epochs opened and checkpoints taken only on
an averaged boundary), which bit-for-bit resume with several ranks rests on."""

from __future__ import annotations

import pytest

from flodl_bus.coordinator.config import CoordinatorConfig
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.effects import Broadcast, Send
from flodl_bus.protocol import messages as m
from tests.coordinator.sim import Cluster

SYNC_MODES = ("nccl-sync", "cpu-sync")


def config(mode: str, *, lockstep: bool = True, **kw: object) -> CoordinatorConfig:
    fields: dict[str, object] = {
        "mode": mode,
        "world_size": 2,
        "total_samples": 200,
        "batch_size": 10,
        "num_epochs": 3,
    }
    return CoordinatorConfig(**(fields | {"lockstep": lockstep} | kw))  # type: ignore[arg-type]


def rounds(mode: str, speeds: list[int], *, lockstep: bool = True) -> list[list[tuple[int, int]]]:
    cluster = Cluster(config(mode, lockstep=lockstep), speeds=speeds)
    cluster.run()
    for e in range(cluster.cfg.num_epochs):
        assert sorted(cluster.trained_by_epoch()[e]) == cluster.expected_epoch(e)
    return [rk.rounds_seen for rk in cluster.ranks]


@pytest.mark.parametrize("mode", SYNC_MODES)
def test_where_rounds_fall_and_what_each_weighs_does_not_depend_on_rank_speed(mode: str) -> None:
    even = rounds(mode, [1, 1])
    assert rounds(mode, [1, 7]) == even
    assert rounds(mode, [9, 2]) == even
    # Every round weighs one batch of each rank: nothing trains past its window.
    assert {steps for seen in even for steps, _ in seen} <= {0, 1}
    # Without lockstep the same speeds give other rounds (what the setting is for).
    assert rounds(mode, [1, 7], lockstep=False) != rounds(mode, [9, 2], lockstep=False)


@pytest.mark.parametrize("mode", SYNC_MODES)
def test_every_plan_is_one_batch_and_none_goes_out_while_its_rank_has_unaveraged_steps(
    mode: str,
) -> None:
    cluster = Cluster(config(mode), speeds=[1, 5])
    cluster.run()
    plans = [msg.plan for _, msg in cluster.sent if isinstance(msg, m.StartEpoch)]
    assert plans and all(p.partition_size == cluster.cfg.batch_size for p in plans)
    assert cluster.count_sent(m.ExtendPartition) == 0


def test_an_epoch_opens_only_after_its_predecessors_last_window_is_averaged() -> None:
    core = Coordinator(config("nccl-sync", num_epochs=2, total_samples=20))
    out = core.start(0.0)
    plans = [o for o in out if isinstance(o, Send) and isinstance(o.msg, m.StartEpoch)]
    assert [(o.rank, o.msg.plan.epoch) for o in plans] == [(0, 0), (1, 0)]
    # Rank 0 trains its one batch and reports; rank 1 has not stepped yet: no reduce,
    # no new plan for rank 0 (its window is not averaged), no epoch 1.
    core.handle(0, m.Batch(0, 1.0, 0.0, 1, 0.5), 0.1)
    later = core.handle(0, m.MetricsMsg(0, 0, 0.5, 1, 1.0, 10, 1.0, 1.0, 0.0), 0.1)
    later += core.tick(0.1)
    assert not any(isinstance(o, Send) and isinstance(o.msg, m.StartEpoch) for o in later)
    core.handle(1, m.Batch(1, 1.0, 0.0, 1, 0.5), 0.2)
    done = core.handle(1, m.MetricsMsg(1, 0, 0.5, 1, 1.0, 10, 1.0, 1.0, 0.0), 0.2)
    done += core.tick(0.2)
    kinds = [type(o.msg).__name__ for o in done if isinstance(o, (Send, Broadcast))]
    # The last window's round goes out before any plan of epoch 1.
    assert kinds.index("SyncNow") < kinds.index("StartEpoch")


def test_an_epoch_checkpoint_is_taken_on_the_averaged_boundary_before_any_plan() -> None:
    cluster = Cluster(config("cpu-sync", checkpoint_every=2, save_path="/nowhere/m"), speeds=[1, 3])
    cluster.run()
    (ckpt,) = [meta for meta in cluster.metas if meta["reason"] == "checkpoint"]
    cov = ckpt["coverage"]
    assert isinstance(cov, dict)
    # Nothing of epoch 2 was handed out: the resume trains all of it, nothing twice.
    assert cov["next_epoch"] == 2 and cov["epochs"] == []
    saves = [i for i, (_, msg) in enumerate(cluster.sent) if isinstance(msg, m.SaveConsensusModel)]
    first_plan_2 = next(
        i
        for i, (_, msg) in enumerate(cluster.sent)
        if isinstance(msg, m.StartEpoch) and msg.plan.epoch == 2
    )
    # Broadcast, so every rank writes its own state beside the model, before epoch 2.
    assert saves[0] < first_plan_2
    assert all(r is None for r, msg in cluster.sent if isinstance(msg, m.SaveConsensusModel))


@pytest.mark.parametrize("mode", ["nccl-cadence", "cpu-async"])
def test_lockstep_outside_a_sync_mode_is_refused_with_the_fix(mode: str) -> None:
    with pytest.raises(ValueError, match=r"lockstep needs .* use --mode nccl-sync or cpu-sync"):
        config(mode)
    with pytest.raises(ValueError, match="progressive"):
        config("nccl-sync", progressive=True)
