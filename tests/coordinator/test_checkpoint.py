"""Checkpoint meta with coverage and resume (reference §4.14.3-§4.14.4)."""

from __future__ import annotations

import json

import pytest

from flodl_bus.coordinator.config import CoordinatorConfig
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.effects import WriteMeta
from flodl_bus.coordinator.guard import SUPPRESS, MsfGuard
from flodl_bus.partition import make_partition
from flodl_bus.protocol import messages as m
from tests.coordinator.sim import Cluster


def config(mode: str, **kw: object) -> CoordinatorConfig:
    base: dict[str, object] = {
        "world_size": 3,
        "total_samples": 900,
        "batch_size": 8,
        "num_epochs": 4,
        "checkpoint_every": 1,
        "save_path": "/tmp/flodl-ckpt",
    }
    base.update(kw)
    return CoordinatorConfig(mode=mode, **base)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["nccl-sync", "cpu-cadence", "cpu-async"])
def test_resume_trains_only_the_uncovered_samples(mode: str) -> None:
    cfg = config(mode)
    first = Cluster(cfg, [1, 2, 3])
    first.run()
    metas = [meta for meta in first.metas if meta["reason"] == "checkpoint"]
    assert len(metas) >= 2
    # The meta travels as JSON on disk.
    meta = json.loads(json.dumps(metas[len(metas) // 2]))
    cov = meta["coverage"]
    assert cov["seed"] == 42 and cov["batch_size"] == 8

    resumed = Cluster(cfg, [2, 1, 3], core=Coordinator.from_meta(cfg, meta))
    resumed.run()
    holes = {e["epoch"]: e["uncovered"] for e in cov["epochs"]}
    trained = resumed.trained_by_epoch()
    for e in range(cfg.num_epochs):
        if e in holes:
            want = [
                p
                for off, size in holes[e]
                for p in make_partition(off, size, cfg.pick_space, e, cfg.seed, cfg.epoch_splits)
            ]
        elif e >= cov["next_epoch"]:
            want = resumed.expected_epoch(e)
        else:
            want = []
        assert sorted(trained.get(e, [])) == sorted(want), f"epoch {e}"
    batches = sum(len(v) for v in trained.values()) // 8
    assert resumed.core.global_step == meta["global_step"] + batches
    assert resumed.count_sent(m.Shutdown) == 1


def test_a_world_of_one_saved_with_a_plan_held_ahead_resumes_onto_every_sample_once() -> None:
    # issue 27: a save taken while the next epoch's plan waits in the rank's mailbox
    # counts that epoch as untrained; a resume trains it whole, and nothing twice
    cfg = config("cpu-cadence", world_size=1, num_epochs=6, checkpoint_every=2)
    first = Cluster(cfg, [1])
    first.run()
    metas = [meta for meta in first.metas if meta["reason"] == "checkpoint"]
    held = [
        meta
        for meta in metas
        if any(
            e["uncovered"] == [[0, cfg.epoch_batches(e["epoch"]) * 8]]
            for e in meta["coverage"]["epochs"]
        )
    ]
    assert held  # some save saw an epoch held ahead, none of it trained
    for meta in held:
        meta = json.loads(json.dumps(meta))
        cov = meta["coverage"]
        resumed = Cluster(cfg, [1], core=Coordinator.from_meta(cfg, meta))
        resumed.run()
        holes = {e["epoch"]: e["uncovered"] for e in cov["epochs"]}
        trained = resumed.trained_by_epoch()
        for e in range(cfg.num_epochs):
            if e in holes:
                want = sorted(
                    p
                    for off, size in holes[e]
                    for p in make_partition(off, size, cfg.pick_space, e, cfg.seed)
                )
            else:
                want = resumed.expected_epoch(e) if e >= cov["next_epoch"] else []
            assert sorted(trained.get(e, [])) == want, f"epoch {e}"
        assert resumed.ranks[0].dropped_plans == 0


@pytest.mark.parametrize("mode", ["nccl-cadence", "cpu-cadence", "nccl-sync"])
def test_checkpoint_at_epoch_checkpoints_as_the_run_enters_each_named_epoch_only(
    mode: str,
) -> None:
    cfg = config(mode, num_epochs=5, checkpoint_every=None, checkpoint_at_epoch=(1, 3))
    cluster = Cluster(cfg, [1, 2, 3])
    cluster.run()
    asked = [msg.version for _, msg in cluster.sent if isinstance(msg, m.Checkpoint)]
    assert asked == [1, 3]
    saves = [meta for meta in cluster.metas if meta["reason"] == "checkpoint"]
    assert len(saves) == 2
    # each save covers what was trained by then: all of epoch 0 (then 0..2), no more
    for save, entered in zip(saves, (1, 3), strict=True):
        assert save["coverage"]["next_epoch"] >= entered
        assert all(e["epoch"] >= entered - 1 for e in save["coverage"]["epochs"])


def test_checkpoint_at_an_epoch_the_run_never_enters_is_refused_naming_the_range() -> None:
    for bad in ((0,), (4,), (2, 9)):
        with pytest.raises(ValueError, match=r"use 1\.\.3"):
            config("cpu-cadence", checkpoint_at_epoch=bad)


def test_meta_written_on_shutdown_with_save_covers_in_flight_work() -> None:
    cfg = config("cpu-cadence", world_size=2, total_samples=100, batch_size=1, num_epochs=2)
    core = Coordinator(cfg)
    core.start(0.0)
    out = core.tick(31.0)  # both ranks silent: every rank lost
    metas = [o.meta for o in out if isinstance(o, WriteMeta)]
    assert metas[0]["reason"] == "all_ranks_lost"
    cov = metas[0]["coverage"]
    assert cov["epochs"] == [{"epoch": 0, "uncovered": [[0, 100]]}]
    assert cov["next_epoch"] == 1
    resumed = Coordinator.from_meta(cfg, metas[0])
    assert resumed.start_epoch == 0


def test_resume_refuses_a_different_seed_or_schema() -> None:
    cfg = config("cpu-cadence")
    core = Coordinator(cfg)
    core.start(0.0)
    meta = next(o.meta for o in core.tick(31.0) if isinstance(o, WriteMeta))
    with pytest.raises(ValueError, match="seed"):
        Coordinator.from_meta(config("cpu-cadence", seed=7), meta)
    with pytest.raises(ValueError, match="schema"):
        Coordinator.from_meta(cfg, {**meta, "schema": 4})


def test_resume_of_a_finished_run_shuts_down_at_once() -> None:
    cfg = config("nccl-cadence", num_epochs=1)
    first = Cluster(cfg, [1, 1, 1])
    first.run()
    final = first.metas[-1]
    core = Coordinator.from_meta(cfg, final)
    out = core.start(0.0)
    assert [type(o).__name__ for o in out][-1] == "Finished"


def test_a_resume_continues_the_controllers_where_the_checkpoint_left_them() -> None:
    cfg = config("cpu-async", guard="msf")
    core = Coordinator(cfg)
    core.max_overshoot = 9
    core.meta.observe([0.1, 0.1, 0.1], 20, SUPPRESS, "stable")
    core.roles.observe("epoch_fn", 120.0)
    assert isinstance(core.guard, MsfGuard)
    core.guard.report([0.01], 5)
    core.guard.report([0.02], 5)
    meta = json.loads(json.dumps(core.checkpoints.meta(m.SaveReason.CHECKPOINT, {})))
    sched = meta["scheduler"]
    assert sched["max_overshoot"] == 9 and sched["callback_ewma_ms"]["epoch_fn"] == 120.0
    meta["coverage"] = core.checkpoints.coverage()
    resumed = Coordinator.from_meta(cfg, meta)
    assert resumed.max_overshoot == 9
    assert resumed.meta.state() == core.meta.state()
    assert resumed.roles.ewma_ms == core.roles.ewma_ms
    assert isinstance(resumed.guard, MsfGuard)
    assert resumed.guard.state() == core.guard.state()
    # the next window reads the same rate on both: the EMA continued, not restarted
    assert resumed.guard.report([0.04], 5) == core.guard.report([0.04], 5)
    assert resumed.guard.rate == core.guard.rate


def test_a_meta_without_the_scheduler_block_still_resumes_with_fresh_controllers() -> None:
    cfg = config("cpu-async")
    core = Coordinator(cfg)
    meta = core.checkpoints.meta(m.SaveReason.CHECKPOINT, core.checkpoints.coverage())
    del meta["scheduler"]
    resumed = Coordinator.from_meta(cfg, meta)
    assert resumed.max_overshoot == 3 and resumed.meta.state()["lrs"] == []


def test_a_resume_continues_elches_growth_state_and_the_elected_roles() -> None:
    """A mid-run cadence run: the resumed core's ElChe and roles equal the saved one's
    (its next windows grow, elect and share exactly as the run that never stopped)."""
    cfg = config("cpu-cadence", num_epochs=3)
    cluster = Cluster(cfg, speeds=[1, 4, 2])
    cluster.run()
    core = cluster.core
    assert core.elche.calibrated and core.roles.epoch_callback == 0
    core.roles.epoch_callback = core.roles.eval = core.roles.checkpoint = 2
    meta = json.loads(json.dumps(core.checkpoints.meta(m.SaveReason.CHECKPOINT, {})))
    meta["coverage"] = core.checkpoints.coverage()
    resumed = Coordinator.from_meta(cfg, meta)
    assert resumed.elche.state() == core.elche.state()
    assert resumed.elche.recent_batch_share() == core.elche.recent_batch_share()
    assert (resumed.roles.epoch_callback, resumed.roles.eval, resumed.roles.checkpoint) == (
        2,
        2,
        2,
    )
    assert resumed.roles.dirty  # the ranks hear the role before the first plan
