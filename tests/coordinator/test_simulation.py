"""Whole runs of the core against simulated ranks, one per mode (reference §4.7)."""

from __future__ import annotations

import pytest

from flodl_bus.coordinator.config import MODES, CoordinatorConfig
from flodl_bus.protocol import messages as m
from tests.coordinator.sim import Cluster


@pytest.mark.parametrize("mode", MODES)
def test_every_sample_of_each_epoch_trained_exactly_once(mode: str) -> None:
    cfg = CoordinatorConfig(
        mode=mode,
        world_size=3,
        total_samples=1797,  # the digits set: the sub-batch tail is never dispatched
        batch_size=16,
        num_epochs=4,
        epoch_splits=2,
        eval_every=2,
        final_eval=True,
    )
    cluster = Cluster(cfg, speeds=[1, 3, 7])
    cluster.run()

    trained = cluster.trained_by_epoch()
    for e in range(cfg.num_epochs):
        assert sorted(trained[e]) == cluster.expected_epoch(e), f"epoch {e}"
    core = cluster.core
    assert core.version > 0
    # every trained batch is counted once in the LR position, SyncAcks never
    assert core.global_step == sum(len(v) for v in trained.values()) // cfg.batch_size
    assert all(rk.global_step == core.global_step for rk in cluster.ranks)
    assert all(rk.dropped_plans == 0 for rk in cluster.ranks)  # one chunk in flight
    assert cluster.count_sent(m.Shutdown) == 1
    assert cluster.finished is not None and cluster.finished.reason is None
    assert all(rk.exited for rk in cluster.ranks)
    # aggregated metrics agree with what the ranks trained
    agg = cluster.ranks[0].aggregated
    assert [a.epoch for a in agg] == list(range(cfg.num_epochs))
    for a in agg:
        assert sum(a.per_rank_samples) == len(cluster.expected_epoch(a.epoch))
    assert cluster.ranks[0].evals[-1] == (cfg.num_epochs, 0.9)


@pytest.mark.parametrize("mode", ["cpu-cadence", "cpu-async"])
def test_cadence_gives_the_fast_rank_the_larger_share(mode: str) -> None:
    cfg = CoordinatorConfig(mode=mode, world_size=3, total_samples=2000, batch_size=8, num_epochs=3)
    cluster = Cluster(cfg, speeds=[1, 3, 7])
    cluster.run()
    share = [len(rk.trained) for rk in cluster.ranks]
    assert share[0] > share[1] > share[2]


@pytest.mark.parametrize("mode", MODES)
def test_a_rank_dying_mid_run_leaves_every_sample_covered(mode: str) -> None:
    cfg = CoordinatorConfig(
        mode=mode,
        world_size=4,
        total_samples=1200,
        batch_size=8,
        num_epochs=2,
        heartbeat_timeout=0.05,
    )
    cluster = Cluster(cfg, speeds=[1, 2, 3, 2])
    cluster.heartbeat_every_ms = 10
    cluster.kill_at[2] = 40
    cluster.run()
    trained = cluster.trained_by_epoch()
    for e in range(cfg.num_epochs):
        assert set(trained[e]) == set(cluster.expected_epoch(e)), f"epoch {e}"
    assert cluster.core.live.dead == [False, False, True, False]
    assert cluster.finished is not None and cluster.finished.reason is None
    if mode.startswith("nccl"):
        assert cluster.count_sent(m.DeclareDead) == 1
        assert sorted(cluster.ranks[0].sessions) == [(0, 3)]
